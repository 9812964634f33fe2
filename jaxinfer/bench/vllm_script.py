"""Runs a throughput workload through vLLM; executed by vLLM's own Python (`make vllm-env`).

    .venv-vllm/bin/python jaxinfer/bench/vllm_script.py MODEL_DIR REQUESTS.json OUT.json \
        --max-num-seqs 64 --max-num-batched-tokens 1024 --max-model-len 384 --dtype float32

This file imports nothing of jaxinfer (jaxinfer is not installed in vLLM's environment) and
runs only under the `__main__` guard, because vLLM's CPU engine starts worker processes that
import the main module again. The requests are token ids (no tokenizer: `skip_tokenizer_init`);
each is greedy, `ignore_eos`, exactly its output length, as `jaxinfer bench throughput` asks of
every backend. The output JSON holds the start-up seconds (building `LLM`, which includes
vLLM's warm-up), the elapsed seconds of the timed `generate` call, and each request's tokens.
With `--latency N`, it then times the first request's prompt alone (batch 1), generating 1 and
N tokens (median of 3 each), and adds batch-1 decode ms/token, (t_N - t_1) / (N - 1), the
same measure as `jaxinfer bench latency`.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", help="HF checkpoint directory")
    parser.add_argument("requests", help="JSON list of {request_id, prompt_token_ids, "
                                         "output_len}")
    parser.add_argument("output", help="where to write the JSON result")
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--latency", type=int, default=0,
                        help="also time batch-1 decode over this many tokens (>= 2)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.requests) as file:
        requests = json.load(file)
    started = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=request["prompt_token_ids"])
               for request in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=request["output_len"],
                             min_tokens=request["output_len"], ignore_eos=True,
                             detokenize=False) for request in requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    token_ids = {request["request_id"]: list(output.outputs[0].token_ids)
                 for request, output in zip(requests, outputs, strict=True)}
    result = {"startup_s": startup, "elapsed_s": elapsed, "token_ids": token_ids}
    if args.latency >= 2:
        def seconds(tokens: int) -> float:
            single = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens,
                                    ignore_eos=True, detokenize=False)
            times = []
            for _ in range(3):
                begin = time.perf_counter()
                llm.generate(prompts[:1], single, use_tqdm=False)
                times.append(time.perf_counter() - begin)
            return sorted(times)[1]

        first, whole = seconds(1), seconds(args.latency)
        result["decode_ms_per_token"] = 1000 * (whole - first) / (args.latency - 1)
    with open(args.output, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
