"""jaxinfer against HF transformers on one GPU, same weights: decode at batch 1, 64-request
throughput, each against the HBM floor measured in the same process.

    python benchmarks/gpu/bench_gpu.py [--layers 16] [--requests 64]

Run by `benchmarks/gpu/run.sh` on a lent accelerator machine (JAX with CUDA and torch there).
The model is a random ~1B Llama in bfloat16 (hidden 2048, 16 layers, 32 query / 8 KV heads,
MLP 5632, vocab 32000). Both sides run the same requests greedily with EOS ignored:
- batch 1: 128 tokens after a 128-token prompt, decode ms/token = (t(128) - t(1)) / 127;
- throughput: `--requests` prompts of 64-256 tokens, 128 output tokens each; jaxinfer's engine
  with every request submitted at once, HF `generate` in static batches of 16.
The HBM floor of a decode step is (weights + the KV it reads) / the bandwidth of a large
on-device reduction, measured here. A short table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def hbm_bandwidth() -> float:
    """Bytes/s of a 2 GiB bfloat16 reduction on the first device."""
    x = jnp.ones((1 << 30,), jnp.bfloat16)  # [2^30]: 2 GiB
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    times = []
    for _ in range(5):
        started = time.perf_counter()
        jax.block_until_ready(total(x))
        times.append(time.perf_counter() - started)
    return x.nbytes / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()

    from jaxinfer.bench import hf_peer
    from jaxinfer.bench.throughput import build_engine, run_engine
    from jaxinfer.bench.workload import make_requests
    from jaxinfer.model_loading import load_model

    model = load_model("random:llama-3.2-1b", num_layers=args.layers, vocab_size=32000,
                       intermediate_size=5632, dtype="bfloat16", param_dtype="bfloat16",
                       tie_word_embeddings=False)
    config = model.config
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(
        __import__("flax").nnx.state(model)))
    bandwidth = hbm_bandwidth()
    rows = []

    # Batch 1 decode.
    single = make_requests(1, vocab_size=config.vocab_size, input_len=128, output_len=128,
                           seed=0)
    engine = build_engine(model, dict(max_num_seqs=64, max_num_batched_tokens=2048,
                                      min_token_bucket=1), 512)
    warm = engine.warm_up()
    one = make_requests(1, vocab_size=config.vocab_size, input_len=128, output_len=1, seed=0)

    def timed(requests) -> float:
        return statistics.median(run_engine(engine, requests).elapsed_s for _ in range(3))

    decode_ms = 1000 * (timed(single) - timed(one)) / 127
    kv_token = 2 * config.num_kv_heads * config.head_dim * config.num_layers * 2
    floor_ms = 1000 * (weight_bytes + 192 * kv_token) / bandwidth
    rows.append(("jaxinfer decode ms/token, batch 1", decode_ms, floor_ms))

    # Throughput.
    requests = make_requests(args.requests, vocab_size=config.vocab_size,
                             input_len=(64, 256), output_len=128, seed=1)
    run = run_engine(engine, requests)
    output_tokens = sum(request.output_len for request in requests)
    rows.append((f"jaxinfer output tok/s, {len(requests)} requests",
                 output_tokens / run.elapsed_s, None))

    # HF transformers on the same GPU and weights, bfloat16.
    try:
        torch, transformers = hf_peer.require_transformers()
        import tempfile

        from checkpoints import save_hf_checkpoint

        with tempfile.TemporaryDirectory() as directory:
            save_hf_checkpoint(model, directory, dtype="bfloat16")
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.bfloat16).cuda().eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0

        def hf_time(prompts, new_tokens) -> float:
            ids = torch.tensor(prompts, device="cuda")
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.inference_mode():
                hf.generate(input_ids=ids, do_sample=False, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens)
            torch.cuda.synchronize()
            return time.perf_counter() - started

        prompt = [list(single[0].prompt_token_ids)]
        hf_time(prompt, 2)
        hf_decode = 1000 * (statistics.median(hf_time(prompt, 128) for _ in range(3))
                            - statistics.median(hf_time(prompt, 1) for _ in range(3))) / 127
        rows.append(("HF decode ms/token, batch 1", hf_decode, floor_ms))
        elapsed = 0.0
        for start in range(0, len(requests), 16):
            batch = requests[start:start + 16]
            width = max(request.prompt_len for request in batch)
            padded = [[0] * (width - request.prompt_len) + list(request.prompt_token_ids)
                      for request in batch]
            elapsed += hf_time(padded, 128)
        rows.append(("HF output tok/s (static batches of 16)", output_tokens / elapsed, None))
    except Exception as error:  # report, do not hide, a peer that cannot run here
        rows.append((f"HF unavailable: {type(error).__name__}: {error}"[:90], float("nan"),
                     None))

    print(f"\ndevice {jax.devices()[0].device_kind}; weights {weight_bytes / 2**30:.2f} GiB; "
          f"HBM {bandwidth / 1e9:.0f} GB/s measured; jaxinfer warm-up {warm:.1f} s")
    print("| measure | value | HBM floor |\n|---|---:|---:|")
    for name, value, floor in rows:
        floor_text = "" if floor is None else f"{floor:.2f} ms"
        print(f"| {name} | {value:.2f} | {floor_text} |")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
