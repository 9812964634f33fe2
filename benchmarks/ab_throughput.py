"""`jaxinfer bench throughput` on two source trees in turn (A B A B ...), in one run.

    python benchmarks/ab_throughput.py --before /path/to/old/checkout --after . \
        --repeats 3 --out benchmarks/results/engine_seams.md

Each run is a fresh process with `PYTHONPATH` set to one tree, so both trees are measured on
the same machine, in the same minutes, with the same flags; alternating the order spreads the
machine's drift over both. The figure compared is the benchmark's own output tokens per second
(warm-up excluded), as a median over the repeats, and the ratio after / before per pair.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# A small Llama (bench-30m's width, 2 layers) so that warm-up stays short, with enough requests
# and output to measure the engine's host side (scheduling, packing, outputs) and its step.
MODEL_FLAGS = ["--model", "random:bench-30m", "--num-layers", "2"]
BENCH_FLAGS = ["--num-prompts", "96", "--input-len-range", "32,128", "--output-len", "128",
               "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
               "--min-token-bucket", "32", "--bucket-growth", "4", "--seed", "0"]


def run_once(tree: Path, model_flags: list[str]) -> dict:
    """One `jaxinfer bench throughput` process over `tree`; its JSON result."""
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "result.json"
        environment = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, "-m", "jaxinfer.cli", "bench", "throughput",
                        *model_flags, *BENCH_FLAGS, "--output-json", str(output)],
                       cwd=tree, env=environment, check=True, capture_output=True, text=True)
        return json.loads(output.read_text())


def output_tokens_per_second(result: dict) -> float:
    """The engine's output tokens per second in a bench result."""
    return float(result["engine"]["output_tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old source tree")
    parser.add_argument("--after", type=Path, default=Path("."), help="the new source tree")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tree")
    parser.add_argument("--out", type=Path, help="append a markdown section here")
    parser.add_argument("--model", default=None,
                        help="a model with a tokenizer, e.g. builtin:demo, so outputs are "
                             "detokenized too (default: a 2-layer random:bench-30m)")
    args = parser.parse_args()
    model_flags = MODEL_FLAGS if args.model is None else ["--model", args.model]
    before, after = [], []
    for repeat in range(args.repeats):
        # Alternate which tree goes first, so drift does not favour one.
        order = [("before", args.before), ("after", args.after)]
        if repeat % 2:
            order.reverse()
        for name, tree in order:
            value = output_tokens_per_second(run_once(tree.resolve(), model_flags))
            (before if name == "before" else after).append(value)
            print(f"repeat {repeat}: {name} {value:.1f} output tok/s", flush=True)
    ratios = [new / old for old, new in zip(before, after, strict=True)]
    lines = [
        "",
        f"## Engine redesign: throughput before and after, {' '.join(model_flags[1:2])} "
        f"({datetime.date.today()})",
        "",
        f"Command: `python benchmarks/ab_throughput.py --before OLD_TREE --after . "
        f"--repeats {args.repeats}"
        f"{'' if args.model is None else ' --model ' + args.model}`; each run is "
        f"`jaxinfer bench throughput {' '.join(model_flags + BENCH_FLAGS)}` in a fresh process.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or '?'}; "
        "both trees measured alternately in the same run.",
        "",
        "| tree | output tok/s per run | median |",
        "|---|---|---:|",
        f"| before | {', '.join(f'{value:.1f}' for value in before)} | "
        f"{statistics.median(before):.1f} |",
        f"| after | {', '.join(f'{value:.1f}' for value in after)} | "
        f"{statistics.median(after):.1f} |",
        "",
        f"Ratio after / before per pair: {', '.join(f'{ratio:.3f}' for ratio in ratios)}; "
        f"median {statistics.median(ratios):.3f}.",
    ]
    print("\n".join(lines))
    if args.out:
        with args.out.open("a") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
