"""64 requests of the real model in every format it ships in, against its own float32.

    python benchmarks/compressed_throughput.py --out benchmarks/results/engine.md [--json FILE]

The batch companion of `compressed_decode.py` (batch 1): the same files (the GGUF file
`make demo` serves, the float32 HF directory, the RTN int8 and int4 checkpoints, bfloat16),
each run as `jaxinfer bench throughput --model FILE` in a fresh process with the bench's
documented serving settings: 64 requests, prompts of 64-256 tokens, 128 greedy tokens each
(EOS ignored), seed 0. Issue 34 asks that no compressed format be slower than float32 here.

One measurement at a time, in a quiet phase (`machine_load.quiet_phase`), after the
machine's peaks. Its section of `--out` is replaced, the rest of the file kept.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

from benchmarks.compressed_decode import (  # noqa: E402
    GGUF,
    HF_DIRECTORY,
    _quantized,
    cpu_name,
    machine_peaks,
)
from benchmarks.machine_load import describe, quiet_phase  # noqa: E402
from benchmarks.results_file import replace_section  # noqa: E402

WORKLOAD = ["--num-prompts", "64", "--input-len-range", "64,256", "--output-len", "128",
            "--seed", "0", "--no-roofline"]
TIMEOUT_S = 1800  # per configuration


def configurations() -> list[tuple[str, list[str]]]:
    """(name, model options of `jaxinfer bench throughput`) of every format, float32 first."""
    int8 = _quantized("smollm2-rtn-int8", ["--bits", "8"])
    int4 = _quantized("smollm2-rtn-int4", ["--bits", "4", "--group-size", "32",
                                           "--asymmetric"])
    return [("float32 (HF directory)", ["--model", str(HF_DIRECTORY)]),
            ("GGUF Q4_1 (the file `make demo` serves)", ["--model", str(GGUF)]),
            ("int8 per channel (RTN; tied head int8 g32)", ["--model", str(int8)]),
            ("int4 g32 with zero points (RTN; tied head int8 g32)", ["--model", str(int4)]),
            ("bfloat16 (HF directory, --dtype bfloat16)",
             ["--model", str(HF_DIRECTORY), "--dtype", "bfloat16"])]


def measure(options: list[str]) -> dict:
    """One `jaxinfer bench throughput` run in a fresh process: its engine figures, or the
    error."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "bench.json"
        command = [sys.executable, "-m", "jaxinfer.cli", "bench", "throughput", *options,
                   *WORKLOAD, "--output-json", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                  check=False, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish in {TIMEOUT_S} s"}
        if done.returncode != 0 or not out.is_file():
            lines = done.stderr.strip().splitlines()
            return {"error": lines[-1] if lines else f"exit {done.returncode}"}
        return json.loads(out.read_text())["engine"]


def markdown(report: dict) -> str:
    """The section: output tokens/s of each format and its ratio to float32."""
    peaks = report["peaks"]
    rows = report["rows"]
    fp32 = rows[0] if "output_tokens_per_s" in rows[0] else None
    lines = [
        f"## 64 requests of SmolLM2-135M-Instruct in every format ({report['date']})",
        "",
        f"`{report['command']}`, git {report['commit']}, {report['cpu']}, 2 vCPUs. "
        f"{report['load']}. Peaks measured in the same run: XLA float32 matmul "
        f"{peaks['f32_gflops']:.0f} GFLOP/s, bfloat16 {peaks['bf16_gflops']:.0f}; read "
        f"bandwidth {peaks['read_gb_s']:.1f} GB/s.",
        "",
        "Each row: `jaxinfer bench throughput --model FILE " + " ".join(WORKLOAD) + "` in a "
        "fresh process (the bench's serving settings otherwise).",
        "",
        "| format | output tok/s | total tok/s | elapsed (s) | vs float32 |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "output_tokens_per_s" not in row:
            lines.append(f"| {row['name']} | failed: {row['error'][:120]} | | | |")
            continue
        versus = (f"{row['output_tokens_per_s'] / fp32['output_tokens_per_s']:.2f}x"
                  if fp32 else "-")
        lines.append(f"| {row['name']} | {row['output_tokens_per_s']:.1f} | "
                     f"{row['total_tokens_per_s']:.1f} | {row['elapsed_s']:.1f} | {versus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/engine.md")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = configurations()  # quantized checkpoints are made before the quiet phase
    rows = []
    with quiet_phase() as record:
        peaks = machine_peaks()
        for name, options in runs:
            print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)
            rows.append({"name": name, **measure(options)})
            print(json.dumps(rows[-1]), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/compressed_throughput.py --out "
                   "benchmarks/results/engine.md",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, cwd=ROOT).stdout.strip(),
        "cpu": cpu_name(), "load": describe(record), "peaks": peaks, "rows": rows}
    replace_section(args.out, "compressed-throughput", markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
