"""Batch-1 decode of the real model in every format it ships in, against llama.cpp and HF.

    python benchmarks/compressed_decode.py --out benchmarks/results/engine.md [--json FILE]

Needs `make smollm2` (the GGUF file and its float32 HF directory), `make llamacpp-env` (the
llama.cpp peer, built for this CPU) and the quantized checkpoints the script makes on first
use under `.models/` (`jaxinfer quantize`, round to nearest: int8 per channel, int4 in groups
of 32 with zero points).

One run, one measurement at a time, each configuration in a fresh process with default
options (`LLM(model)`, as a user starts it): greedy decode of 128 tokens after a 32-token
prompt, timed as (t(129 tokens) - t(1 token)) / 128, five times; the median is quoted, with
the minimum beside it. The machine's peaks are measured in the same run (`measure_peaks`:
XLA's float32 and bfloat16 matmul rates, XLA's int8 x int8 -> int32 rate, read bandwidth),
and each figure sits beside its weight-read floor: the bytes its decode step reads (every
weight and the LM head; an embedding table only when it is also the head) over the measured
bandwidth. Peers: llama.cpp (`llama-cpp-python`) on the same GGUF file with 2 threads, and
HF transformers in float32 on the HF directory.

The timed phase waits for a quiet machine (`machine_load.quiet_phase`) and records its load.
Its section of `--out` is replaced, the rest of the file kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

from benchmarks.machine_load import describe, quiet_phase  # noqa: E402
from benchmarks.results_file import replace_section  # noqa: E402

MODELS = ROOT / ".models"
GGUF = Path(os.environ.get("JAXINFER_SMOLLM2_GGUF", Path.home() / ".cache/jaxinfer/models/"
                           "SmolLM2-135M-Instruct.Q4_1.gguf"))
HF_DIRECTORY = MODELS / "smollm2-135m-instruct"
LLAMACPP_PYTHON = ROOT / ".venv-llamacpp/bin/python"
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg of Mainz combined movable metal type, oil-based ink and a wooden press")
NEW_TOKENS = 128
REPEATS = 5
TIMEOUT_S = 900  # per configuration

# The timing loop every process runs: `run(n)` generates n tokens greedily from PROMPT_IDS.
_TIMING = """
import json, statistics, time
def decode_ms(run, new_tokens, repeats):
    run(8)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter(); run(1); one = time.perf_counter() - started
        started = time.perf_counter(); run(new_tokens + 1); many = time.perf_counter() - started
        samples.append((many - one) / new_tokens * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "samples": samples}
"""

_JAXINFER = _TIMING + """
import os, sys
started = time.perf_counter()
from jaxinfer import LLM, SamplingParams
from flax import nnx
import jax
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
ready = time.perf_counter() - started
ids = llm.get_tokenizer().encode(sys.argv[3])[:32]
def run(n):
    llm.generate({"prompt_token_ids": ids},
                 SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
timing = decode_ms(run, int(sys.argv[4]), int(sys.argv[5]))
model = llm.engine.model
leaves = jax.tree.leaves(nnx.state(model))
total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
table = model.embed.weight[...]
# The embedding table is read whole only when it is the head (tied, no separate head).
read = total - (table.size * table.dtype.itemsize if model.lm_head is not None else 0)
print(json.dumps({**timing, "weight_bytes_read": read, "ready_s": ready,
                  "prompt_tokens": len(ids)}))
"""

_LLAMACPP = _TIMING + """
import os, sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_threads=2, n_ctx=512, verbose=False)
ids = llm.tokenize(sys.argv[2].encode(), add_bos=False)[:32]
def run(n):
    llm.reset()
    for index, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1)):
        if index + 1 >= n:
            break
timing = decode_ms(run, int(sys.argv[3]), int(sys.argv[4]))
print(json.dumps({**timing, "weight_bytes_read": os.path.getsize(sys.argv[1]),
                  "prompt_tokens": len(ids)}))
"""

_HF = _TIMING + """
import sys, torch, transformers
torch.set_num_threads(2)
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
ids = torch.tensor([tokenizer.encode(sys.argv[2])[:32]])
def run(n):
    with torch.no_grad():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
timing = decode_ms(run, int(sys.argv[3]), int(sys.argv[4]))
total = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({**timing, "weight_bytes_read": total, "prompt_tokens": ids.shape[1]}))
"""


def _quantized(name: str, arguments: list[str]) -> Path:
    """A `jaxinfer quantize` checkpoint of the HF directory, default options (made once;
    the directory names change with the defaults they were made under)."""
    out = MODELS / name
    if not any(out.glob("*")):
        subprocess.run([sys.executable, "-m", "jaxinfer.cli", "quantize", "--model",
                        str(HF_DIRECTORY), "--method", "rtn", *arguments, "--out", str(out)],
                       check=True)
    return out


def configurations() -> list[dict]:
    """(name, what, how to run) of every measured configuration, peers last."""
    # Made with `--head auto`: SmolLM2's tied head in int8 groups of 32, as GGUF's Q8_0.
    int8 = _quantized("smollm2-rtn-int8", ["--bits", "8"])
    int4 = _quantized("smollm2-rtn-int4", ["--bits", "4", "--group-size", "32",
                                           "--asymmetric"])
    jaxinfer = [
        ("jaxinfer, GGUF Q4_1 (the file `make demo` serves)", str(GGUF), {}, {}, NEW_TOKENS),
        # The default quantizes decode rows' activations to int8 (`JAXINFER_CPU_INT8_
        # ACTIVATIONS=decode`); "off" keeps them float32 everywhere.
        ("jaxinfer, GGUF Q4_1, float32 activations (JAXINFER_CPU_INT8_ACTIVATIONS=off)",
         str(GGUF), {}, {"JAXINFER_CPU_INT8_ACTIVATIONS": "off"}, NEW_TOKENS),
        ("jaxinfer, float32 (HF directory)", str(HF_DIRECTORY), {}, {}, NEW_TOKENS),
        ("jaxinfer, int8 per channel (RTN; tied head int8 g32)", str(int8), {}, {},
         NEW_TOKENS),
        ("jaxinfer, int4 g32 with zero points (RTN; tied head int8 g32)", str(int4), {}, {},
         NEW_TOKENS),
        # On the CPU, dtype="bfloat16" keeps bfloat16 weights and computes in float32
        # (`jaxinfer.model_loading.dtype_overrides`).
        ("jaxinfer, bfloat16 (HF directory, dtype=bfloat16)", str(HF_DIRECTORY),
         {"dtype": "bfloat16"}, {}, NEW_TOKENS),
    ]
    runs = [dict(name=name, command=[sys.executable, "-c", _JAXINFER, path, json.dumps(options),
                                     PROMPT, str(tokens), str(REPEATS if tokens == NEW_TOKENS
                                                                else 2)], env=env)
            for name, path, options, env, tokens in jaxinfer]
    if LLAMACPP_PYTHON.exists():
        runs.append(dict(name="llama.cpp, GGUF Q4_1, 2 threads", env={},
                         command=[str(LLAMACPP_PYTHON), "-c", _LLAMACPP, str(GGUF), PROMPT,
                                  str(NEW_TOKENS), str(REPEATS)]))
    runs.append(dict(name="HF transformers, float32", env={},
                     command=[sys.executable, "-c", _HF, str(HF_DIRECTORY), PROMPT,
                              str(NEW_TOKENS), str(REPEATS)]))
    return runs


def measure(run: dict) -> dict:
    """Runs one configuration in a fresh process; its JSON line, or the error."""
    env = {**os.environ, **run["env"]}
    try:
        done = subprocess.run(run["command"], capture_output=True, text=True, env=env,
                              check=False, cwd=ROOT, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": [f"did not finish in {TIMEOUT_S} s"]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(lines[-1])


def machine_peaks() -> dict:
    """XLA's float32, bfloat16 and int8 matmul rates and the read bandwidth, measured now."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.bench.roofline import _best_seconds, measure_peaks

    f32, bf16 = measure_peaks("float32"), measure_peaks("bfloat16")
    size = 2048
    matrix = jnp.ones((size, size), jnp.int8)  # [2048, 2048]
    int8_dot = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32))
    int8_seconds = _best_seconds(int8_dot, matrix, matrix)
    return {"f32_gflops": f32.matmul_flops / 1e9, "bf16_gflops": bf16.matmul_flops / 1e9,
            "int8_gops": 2 * size ** 3 / int8_seconds / 1e9,
            "read_gb_s": f32.read_bytes / 1e9}


def cpu_name() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def markdown(report: dict) -> str:
    peaks = report["peaks"]
    fp32 = next((row for row in report["rows"] if row["name"].startswith("jaxinfer, float32")
                 and "median_ms" in row), None)
    llamacpp = next((row for row in report["rows"] if row["name"].startswith("llama.cpp")
                     and "median_ms" in row), None)
    lines = [
        f"## Batch-1 decode of SmolLM2-135M-Instruct in every format ({report['date']})",
        "",
        f"`{report['command']}`, git {report['commit']}, {report['cpu']} ({report['flags']}), "
        f"2 vCPUs. {report['load']}. Peaks measured in the same run: XLA float32 matmul "
        f"{peaks['f32_gflops']:.0f} GFLOP/s, bfloat16 {peaks['bf16_gflops']:.0f}, int8 x int8 "
        f"-> int32 {peaks['int8_gops']:.0f} GOP/s; read bandwidth {peaks['read_gb_s']:.1f} GB/s.",
        "",
        f"Greedy decode of {NEW_TOKENS} tokens after a 32-token prompt, (t(129) - t(1)) / 128, "
        f"median of {REPEATS} (min beside it), each configuration a fresh process with default "
        "options. Floor: the bytes the step reads / the read bandwidth.",
        "",
        "| configuration | ms/token (median) | min | weights read (MB) | read floor (ms) | "
        "vs jaxinfer fp32 | vs llama.cpp |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        if "median_ms" not in row:
            lines.append(f"| {row['name']} | failed: {' '.join(row['error'])[:120]} | | | | | |")
            continue
        floor = row["weight_bytes_read"] / (peaks["read_gb_s"] * 1e9) * 1e3
        versus_fp32 = f"{fp32['median_ms'] / row['median_ms']:.2f}x" if fp32 else "-"
        versus_llamacpp = (f"{llamacpp['median_ms'] / row['median_ms']:.2f}x" if llamacpp
                           else "-")
        lines.append(f"| {row['name']} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | "
                     f"{row['weight_bytes_read'] / 1e6:.0f} | {floor:.1f} | {versus_fp32} | "
                     f"{versus_llamacpp} |")
    lines += ["", "(\"vs\" columns: the other's ms/token over this row's; above 1 is faster.)"]
    return "\n".join(lines)


def merge_rounds(results: list[dict]) -> dict:
    """One row from a configuration's rounds: median and minimum over every sample, the
    other fields of the last round (the first error, if every round failed)."""
    good = [result for result in results if "samples" in result]
    if not good:
        return results[0]
    samples = [sample for result in good for sample in result["samples"]]
    return {**good[-1], "median_ms": statistics.median(samples), "min_ms": min(samples),
            "samples": samples, "rounds": len(good)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/engine.md")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", default=None,
                        help="measure only configurations whose name contains this")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the configurations this many times, in turn (A B A B: "
                             "on a noisy machine a slow minute then hits every row); each "
                             "row's median and minimum are over all its samples")
    args = parser.parse_args(argv)
    runs = [run for run in configurations()  # quantized checkpoints are made first
            if args.only is None or args.only in run["name"]]
    measured: dict[str, list[dict]] = {run["name"]: [] for run in runs}
    with quiet_phase() as record:
        peaks = machine_peaks()
        for _ in range(max(1, args.rounds)):
            for run in runs:
                print(f"[{time.strftime('%H:%M:%S')}] {run['name']}", flush=True)
                measured[run["name"]].append(measure(run))
                print(json.dumps(measured[run["name"]][-1]), flush=True)
    rows = [{"name": name, **merge_rounds(results)} for name, results in measured.items()]
    flags = Path("/proc/cpuinfo").read_text()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/compressed_decode.py --out benchmarks/results/engine.md"
                   + (f" --only '{args.only}'" if args.only else "")
                   + (f" --rounds {args.rounds}" if args.rounds > 1 else ""),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, cwd=ROOT).stdout.strip(),
        "cpu": cpu_name(),
        "flags": ", ".join(flag for flag in ("avx512f", "avx512_vnni", "avx512_bf16",
                                              "amx_tile") if f" {flag}" in flags) or "AVX2, FMA",
        "load": describe(record), "peaks": peaks, "rows": rows}
    replace_section(args.out, "compressed-decode", markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
