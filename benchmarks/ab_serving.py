"""`jaxinfer bench serve` against servers from two source trees, alternately, in one run.

    python benchmarks/ab_serving.py --before /path/to/old/checkout --after . --repeats 5 \
        --out benchmarks/results/reliability.md

Starts `jaxinfer serve --model builtin:demo` from each tree (`PYTHONPATH` set to the tree; both
warmed up and idle while the other is measured), then runs the same load against one and
then the other, alternating which goes first, over both front ends in turn. The load client is
this tree's, so only the servers differ. The figure compared is the load's output tokens per
second, as the median over the repeats of each pair's ratio after / before.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

SERVER_FLAGS = ("--max-num-seqs", "32", "--max-num-batched-tokens", "512",
                "--no-prompt-logprobs")
LOAD_FLAGS = ("--num-prompts", "64", "--random-input-len", "64", "--random-output-len", "32",
              "--request-rate", "inf", "--seed", "0")


def run_load(backend: str, port: int) -> float:
    """One `jaxinfer bench serve` run; its output tokens per second."""
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "result.json"
        subprocess.run([sys.executable, "-m", "jaxinfer.cli", "bench", "serve", "--backend",
                        backend, "--port", str(port), *LOAD_FLAGS, "--output-json",
                        str(output)], cwd=ROOT, check=True, capture_output=True, text=True)
        result = json.loads(output.read_text())
    return float(result["runs"][0]["output_throughput"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old source tree")
    parser.add_argument("--after", type=Path, default=ROOT, help="the new source tree")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="append a markdown section here")
    args = parser.parse_args()

    from serve.launcher import ServerProcess

    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    servers = {name: ServerProcess("builtin:demo", *SERVER_FLAGS, capture_output=True,
                                   env={**os.environ, "PYTHONPATH": str(tree)})
               for name, tree in trees.items()}
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for server in servers.values():
            server.start()
        for repeat in range(args.repeats):
            for backend in ("openai", "grpc"):
                order = ["before", "after"] if repeat % 2 == 0 else ["after", "before"]
                for name in order:
                    server = servers[name]
                    port = server.http_port if backend == "openai" else server.grpc_port
                    rate = run_load(backend, port)
                    rates.setdefault((backend, name), []).append(rate)
                    print(f"repeat {repeat} {backend} {name}: {rate:.1f} output tok/s",
                          flush=True)
    finally:
        for server in servers.values():
            server.stop()
    lines = ["", f"## Serving throughput before and after ({datetime.date.today()})", "",
             f"Command: `python benchmarks/ab_serving.py --before OLD_TREE --after . "
             f"--repeats {args.repeats}`; servers: `jaxinfer serve --model builtin:demo "
             f"{' '.join(SERVER_FLAGS)}`, load: `jaxinfer bench serve {' '.join(LOAD_FLAGS)}`.",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, "
             f"{platform.processor() or '?'}; both servers measured alternately in one run "
             "(client and servers share the CPUs).", "",
             "| front end | before, output tok/s | after, output tok/s | after / before per "
             "pair | median ratio |", "|---|---|---|---|---:|"]
    worst = float("inf")
    for backend in ("openai", "grpc"):
        before, after = rates[(backend, "before")], rates[(backend, "after")]
        ratios = [new / old for old, new in zip(before, after, strict=True)]
        worst = min(worst, statistics.median(ratios))
        lines.append(f"| {backend} | {', '.join(f'{v:.0f}' for v in before)} | "
                     f"{', '.join(f'{v:.0f}' for v in after)} | "
                     f"{', '.join(f'{r:.3f}' for r in ratios)} | "
                     f"{statistics.median(ratios):.3f} |")
    lines += ["", f"Lowest median ratio: {worst:.3f} (the target: no drop past 5%, >= 0.95).",
              ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with args.out.open("a") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
