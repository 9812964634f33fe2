"""The speed report: jaxinfer against HF transformers and vLLM for CPU, side by side, in one run.

    python benchmarks/speed_report.py --out benchmarks/results/engine.md [--skip-vllm]

One run, on one machine, in sequence (never two measurements at once):
1. the machine's peaks (f32 and bf16 matmul, read bandwidth), measured here;
2. throughput of the bench-30m shape (fp32, 64 requests, prompts 64-256, 128 greedy tokens,
   EOS ignored): the engine with the documented serving settings (`BENCH_DEFAULTS`), HF
   transformers `generate` in static batches of 16, and vLLM for CPU (`make vllm-env`), with
   token agreement, and the engine's prefill and decode@1/16/64 steps against their roofline;
3. `LLM(model)` with no options, as a user runs it, in a fresh process with an empty
   compilation cache: construction (warm-up included) and the same 64 requests;
4. warm-up of the 64-sequence / 1024-token configuration, cold (empty compilation cache)
   and warm (the same cache again), for bench-30m and a 30-layer model of SmolLM2-135M's shape,
   each in a fresh process;
5. compile time of the largest step against depth (8, 16, 32 layers);
6. batch-1 decode latency against HF (and vLLM, timed in its throughput process);
7. with `make smollm2` done, the real pretrained SmolLM2-135M-Instruct (float32 HF checkpoint
   from its GGUF): 64 requests (prompts 64-256, 64 greedy tokens) against HF and vLLM in
   float32, and jaxinfer's fastest CPU configuration (float32) against vLLM in bfloat16, with
   torch's bf16 matmul rate (oneDNN, AMX where the CPU has it) beside XLA's.
The markdown section is appended to `--out`; the numbers also go to `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/speed_report.py` puts benchmarks/ first on the path, where our kernels.py
# would shadow the `kernels` package transformers imports.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
# SmolLM2-135M's shape (30 layers), random weights.
SMOLLM2_SHAPE = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                     intermediate_size=1536, vocab_size=49152)

_WARM_UP = """
import json, sys, time
started = time.perf_counter()
from jaxinfer.bench.throughput import build_engine, load_bench_model
model = load_bench_model('random:bench-30m', **json.loads(sys.argv[1]))
engine = build_engine(model, None, 384)
built = time.perf_counter()
seconds = engine.warm_up()
print(json.dumps({'warm_up_s': seconds, 'programs': engine.compilations,
                  'start_to_ready_s': time.perf_counter() - started}))
"""

_USER = """
import json, time
from jaxinfer.bench.workload import make_requests
started = time.perf_counter()
from jaxinfer import LLM, SamplingParams
llm = LLM('random:bench-30m')
ready = time.perf_counter()
requests = make_requests(64, vocab_size=llm.engine.model_config.vocab_size,
                         input_len=(64, 256), output_len=128, seed=0)
compiled = llm.engine.compilations
begin = time.perf_counter()
outputs = llm.generate([{'prompt_token_ids': list(r.prompt_token_ids)} for r in requests],
                       SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
elapsed = time.perf_counter() - begin
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(json.dumps({'startup_s': ready - started, 'elapsed_s': elapsed,
                  'output_tokens_per_s': tokens / elapsed,
                  'compiles_during_generate': llm.engine.compilations - compiled,
                  'options': {k: v for k, v in llm.engine.config.options().items()
                              if k in ('max_num_seqs', 'max_num_batched_tokens', 'num_pages',
                                       'max_model_len')}}))
"""

_DEPTH = """
import dataclasses, json, sys, time
from jaxinfer.bench.throughput import build_engine, load_bench_model
from jaxinfer.engine.device.step_io import STEP
results = {}
for layers in (8, 16, 32):
    engine = build_engine(load_bench_model('random:bench-30m', num_layers=layers), None, 384)
    started = time.perf_counter()
    engine.runner.lower(STEP, 1024).compile()
    results[layers] = time.perf_counter() - started
print(json.dumps(results))
"""


def _python(code: str, *args: str, cache: str | None) -> dict:
    environment = {**os.environ, "JAXINFER_COMPILATION_CACHE": cache or "off",
                   "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=environment, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/engine.md")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--real-model", type=Path, default=ROOT / ".models/smollm2-135m-instruct",
                        help="float32 HF checkpoint of SmolLM2-135M-Instruct (`make smollm2`); "
                             "skipped if missing")
    args = parser.parse_args()

    from jaxinfer.bench import latency, roofline, throughput
    from jaxinfer.bench.workload import make_requests

    started = time.perf_counter()
    report: dict = {"machine": throughput.machine_info()}
    peaks = {dtype: roofline.measure_peaks(dtype) for dtype in ("float32", "bfloat16")}
    report["peaks"] = {dtype: vars(peak) for dtype, peak in peaks.items()}

    # 2. Throughput against both peers, with the roofline profile.
    model = throughput.load_bench_model("random:bench-30m")
    requests = make_requests(64, vocab_size=model.config.vocab_size, input_len=(64, 256),
                             output_len=128, seed=0)
    result = throughput.run_throughput(model, requests, None, compare_hf=True,
                                       compare_vllm=not args.skip_vllm,
                                       vllm_latency_tokens=128)
    table = throughput.throughput_table(result)
    result.pop("token_ids")
    report["throughput"] = {key: value for key, value in result.items()
                            if key != "roofline_table"}
    report["workload_floor"] = _workload_floor(model.config, requests, peaks["float32"])

    # 3. LLM(model), as a user runs it.
    with tempfile.TemporaryDirectory() as cache:
        user = _python(_USER, cache=cache)
    report["llm_default"] = user

    # 4. Warm-up, cold and cached, in fresh processes.
    warm_up = {}
    for name, shape in (("bench-30m", {}), ("30 layers (SmolLM2-135M shape)", SMOLLM2_SHAPE)):
        with tempfile.TemporaryDirectory() as cache:
            cold = _python(_WARM_UP, json.dumps(shape), cache=cache)
            cached = _python(_WARM_UP, json.dumps(shape), cache=cache)
        warm_up[name] = {"cold": cold, "cached": cached}
    report["warm_up"] = warm_up

    # 5. Compile time of the largest step against depth.
    report["compile_by_depth"] = _python(_DEPTH, cache=None)

    # 6. Batch-1 latency against HF.
    lat = latency.run_latency(model, batch_sizes=(1,), input_len=32, output_len=128,
                              iterations=3, compare_hf=True)
    report["latency"] = lat["rows"][0]

    # 7. The real model, if converted.
    if (args.real_model / "config.json").exists():
        try:
            report["real_model"] = _real_model(args.real_model, skip_vllm=args.skip_vllm)
        except Exception as error:  # any failure here: keep the rest of the report
            report["real_model_error"] = repr(error)[-2000:]
            print("real model section failed:", report["real_model_error"], file=sys.stderr)
    report["seconds"] = time.perf_counter() - started

    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as out:
        out.write(markdown(report, table) + "\n")
    print(markdown(report, table))


def _torch_matmul_rate(dtype: str) -> float:
    """torch's FLOP/s on a 2048^3 matmul (oneDNN; AMX for bf16 where the CPU has it)."""
    import torch

    size = 2048
    a = torch.rand(size, size, dtype=getattr(torch, dtype))
    b = torch.rand(size, size, dtype=getattr(torch, dtype))
    for _ in range(2):
        a @ b
    times = []
    for _ in range(5):
        begin = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - begin)
    return 2 * size**3 / sorted(times)[2]


def _real_model(directory: Path, *, skip_vllm: bool) -> dict:
    """SmolLM2-135M-Instruct: float32 against HF and vLLM, and against vLLM in bfloat16."""
    from jaxinfer.bench import throughput, vllm_peer
    from jaxinfer.bench.workload import make_requests
    from jaxinfer.model_loading import load_model

    model = load_model(str(directory))
    requests = make_requests(64, vocab_size=model.config.vocab_size, input_len=(64, 256),
                             output_len=64, seed=0)
    result = throughput.run_throughput(model, requests, None, compare_hf=True,
                                       compare_vllm=not skip_vllm, roofline=False)
    table = throughput.throughput_table(result)
    result.pop("token_ids")
    out = {"float32": result, "table": table,
           "torch_bf16_matmul_flops": _torch_matmul_rate("bfloat16"),
           "torch_f32_matmul_flops": _torch_matmul_rate("float32")}
    if not skip_vllm:
        bf16 = load_model(str(directory), dtype="bfloat16", param_dtype="bfloat16")
        settings = result["engine_settings"]
        run = vllm_peer.run_vllm(bf16, requests, max_num_seqs=settings["max_num_seqs"],
                                 max_num_batched_tokens=settings["max_num_batched_tokens"],
                                 max_model_len=settings["max_model_len"])
        out["vllm_bfloat16"] = throughput.rates(requests, run.elapsed_s)
    return out


def _workload_floor(config, requests, peaks) -> dict:
    """The whole workload's roofline floor at XLA's and at torch's f32 matmul rate."""
    from jaxinfer.bench import roofline
    from jaxinfer.bench.workload import total_output_tokens

    cost = roofline.workload_cost(config, [request.prompt_len for request in requests],
                                  requests[0].output_len, len(requests))
    torch_rate = _torch_matmul_rate("float32")
    floors = {"xla": cost.floor_seconds(peaks),
              "best": cost.floor_seconds(roofline.Peaks(max(torch_rate, peaks.matmul_flops),
                                                        peaks.read_bytes, "float32"))}
    output = total_output_tokens(requests)
    return {"gflop": cost.flops / 1e9, "gb_moved": cost.bytes / 1e9,
            "torch_f32_matmul_flops": torch_rate,
            **{f"{name}_floor_s": seconds for name, seconds in floors.items()},
            **{f"{name}_floor_tokens_per_s": output / seconds
               for name, seconds in floors.items()}}


def _floor_lines(report: dict) -> list[str]:
    """The workload's floor against the engine's and HF's measured throughput."""
    floor = report.get("workload_floor")
    if not floor:
        return []
    thr = report["throughput"]
    engine = thr["engine"]["output_tokens_per_s"]
    hf = thr["hf"]["output_tokens_per_s"]
    return [f"Workload floor (`roofline.workload_cost`: every prompt computed once, then 127 "
            f"decode steps over all 64 sequences, no host time; {floor['gflop']:.0f} GFLOP, "
            f"{floor['gb_moved']:.1f} GB moved): {floor['xla_floor_s']:.2f} s at XLA's f32 "
            f"matmul rate = {floor['xla_floor_tokens_per_s']:.0f} output tok/s = "
            f"**{floor['xla_floor_tokens_per_s'] / hf:.2f}x HF**; at the best f32 rate measured "
            f"here (torch {floor['torch_f32_matmul_flops'] / 1e9:.0f} GFLOP/s) "
            f"{floor['best_floor_tokens_per_s']:.0f} tok/s = "
            f"{floor['best_floor_tokens_per_s'] / hf:.2f}x HF. The engine runs at "
            f"{engine / floor['xla_floor_tokens_per_s']:.0%} of the XLA-rate floor; 3x HF "
            f"would need {3 * hf / floor['xla_floor_tokens_per_s']:.0%} of it "
            f"({3 * hf / floor['best_floor_tokens_per_s']:.0%} of the best-rate floor)."]


def markdown(report: dict, table: str) -> str:
    """The report's markdown section."""
    machine, peaks = report["machine"], report["peaks"]
    thr = report["throughput"]
    hf = thr["hf"]["output_tokens_per_s"]
    user = report["llm_default"]
    lines = [f"## Speed report ({machine['date']})", "",
             "```\npython benchmarks/speed_report.py --out benchmarks/results/engine.md\n```", "",
             f"- machine: {machine['platform']}, {machine['processor']}, {machine['cpu_count']} "
             f"CPUs, jax {machine['jax']}, torch {machine['torch']}, transformers "
             f"{machine['transformers']}, git {machine['git']}",
             f"- measured peaks: f32 matmul {peaks['float32']['matmul_flops'] / 1e9:.0f} "
             f"GFLOP/s, bf16 matmul {peaks['bfloat16']['matmul_flops'] / 1e9:.0f} GFLOP/s "
             f"(XLA, 2048^3), read bandwidth {peaks['float32']['read_bytes'] / 1e9:.1f} GB/s",
             "", "### Throughput: bench-30m shape, fp32, 64 requests (prompts 64-256, 128 "
             "greedy tokens)", "", table, "", *_floor_lines(report), "",
             "### `LLM(model)` with no options, as a user runs it (fresh process, empty "
             "compilation cache)", "",
             f"- construction, warm-up included: {user['startup_s']:.1f} s; chosen sizes: "
             f"{user['options']}",
             f"- the same 64 requests: {user['output_tokens_per_s']:.1f} output tok/s = "
             f"**{user['output_tokens_per_s'] / hf:.2f}x HF**; programs compiled during "
             f"generate: {user['compiles_during_generate']}", "",
             "### Warm-up of the 64-sequence / 1024-token configuration (fresh processes)", "",
             "| model | cold warm-up s | cached warm-up s | programs |", "|---|---:|---:|---:|"]
    for name, runs in report["warm_up"].items():
        lines.append(f"| {name} | {runs['cold']['warm_up_s']:.1f} | "
                     f"{runs['cached']['warm_up_s']:.1f} | {runs['cold']['programs']} |")
    depth = report["compile_by_depth"]
    lines += ["", "Compile time of the 1024-token step (scanned layers): " + ", ".join(
        f"{layers} layers {seconds:.1f} s" for layers, seconds in depth.items()), ""]
    row = report["latency"]
    vllm_latency = thr.get("vllm", {}).get("batch_1_decode_ms_per_token")
    lines += ["### Batch-1 decode latency (prompt 32, 128 tokens, median of 3)", "",
              f"- jaxinfer {row['engine']['decode_ms_per_token']:.2f} ms/token, HF "
              f"{row['hf']['decode_ms_per_token']:.2f} ms/token: "
              f"**{row['engine_over_hf']:.2f}x HF**"]
    if vllm_latency:
        lines.append(f"- vLLM-CPU (its first request's prompt alone, 128 tokens, median of 3, "
                     f"in its throughput process): {vllm_latency:.2f} ms/token; jaxinfer = "
                     f"**{row['engine']['decode_ms_per_token'] / vllm_latency:.2f}x vLLM**")
    real = report.get("real_model")
    if real:
        f32 = real["float32"]
        lines += ["", "### Real model: SmolLM2-135M-Instruct (30 layers, float32 from its "
                  "GGUF), 64 requests (prompts 64-256, 64 greedy tokens)", "", real["table"], ""]
        if "vllm_bfloat16" in real:
            engine_rate = f32["engine"]["output_tokens_per_s"]
            bf16_rate = real["vllm_bfloat16"]["output_tokens_per_s"]
            lines.append(f"- vLLM-CPU in bfloat16: {bf16_rate:.1f} output tok/s; jaxinfer's "
                         f"fastest CPU configuration (float32) {engine_rate:.1f} = "
                         f"**{engine_rate / bf16_rate:.2f}x**")
        lines.append(f"- matmul rates here, 2048^3: torch bf16 "
                     f"{real['torch_bf16_matmul_flops'] / 1e9:.0f} GFLOP/s, torch f32 "
                     f"{real['torch_f32_matmul_flops'] / 1e9:.0f}, XLA bf16 "
                     f"{peaks['bfloat16']['matmul_flops'] / 1e9:.0f}, XLA f32 "
                     f"{peaks['float32']['matmul_flops'] / 1e9:.0f}")
    if "real_model_error" in report:
        lines += ["", f"Real model section failed: `{report['real_model_error'][:300]}`"]
    lines += ["", f"(whole report: {report['seconds'] / 60:.1f} min)"]
    return textwrap.dedent("\n".join(lines))


if __name__ == "__main__":
    main()
