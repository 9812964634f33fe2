"""The full soak test (`serve.soak`); its numbers go to benchmarks/results/reliability.md.

    python benchmarks/soak.py [--duration 180] [--out benchmarks/results/reliability.md]

Serves the built-in demo model (the serve tests' engine options) in this process, computes
the greedy offline outputs with `LLM.generate`, runs the soak against the server and reports
streams, cancellations, never-read streams, hostile requests, RSS (the second quarter's peak
against the last quarter's) and lost or wrong outputs, which must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--slow-readers", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/reliability.md"))
    args = parser.parse_args()

    from jaxinfer.llm import LLM
    from serve.server import BackgroundServer
    from serve.soak import SoakConfig, greedy_references, process_rss_bytes, run_soak
    from tests.serve.conftest import ENGINE_OPTIONS, make_service, pool_is_full

    references = greedy_references(LLM("builtin:demo", **ENGINE_OPTIONS))
    config = SoakConfig(duration_s=args.duration, streams=args.streams,
                        slow_readers=args.slow_readers)
    service = make_service(max_queued_requests=10_000)
    with BackgroundServer(service) as server:
        rss_before = process_rss_bytes()
        report = asyncio.run(run_soak(server.http_port, server.grpc_port, references, config,
                                      rss=process_rss_bytes))
        deadline = time.monotonic() + 60
        while not pool_is_full(service) and time.monotonic() < deadline:
            time.sleep(0.1)
        pool_full = pool_is_full(service)
        alive = service.engine.is_running
    problems = report.problems(128 * 2 ** 20)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    mib = 2 ** 20
    lines = [
        f"## Soak ({date})", "",
        f"Command: `python benchmarks/soak.py --duration {args.duration:g} --streams "
        f"{args.streams} --slow-readers {args.slow_readers}`  ",
        f"Machine: {platform.platform()}, {platform.processor() or 'cpu'}; git {git}; "
        f"{report.seconds:.0f} s.", "",
        "| measure | value |", "|---|---:|",
        f"| concurrent stream workers (HTTP and gRPC alternating) | {config.streams} |",
        f"| requests completed and compared with `LLM.generate` | {report.completed} |",
        f"| requests cancelled after their first chunk | {report.cancelled} |",
        f"| never-read streams held open ({config.slow_reader_hold_s:g} s each, "
        f"{config.slow_reader_max_tokens} tokens asked) | {report.slow_readers} |",
        f"| hostile requests interleaved | {report.hostile} |",
        f"| hostile requests answered otherwise than expected | "
        f"{len(report.hostile_unexpected)} |",
        f"| lost requests (failed or hung) | {len(report.lost)} |",
        f"| wrong outputs | {len(report.wrong)} |",
        f"| RSS before the soak | {rss_before / mib:.0f} MiB |",
        f"| peak RSS, second quarter / last quarter | {report.rss_window(0.25, 0.5) / mib:.0f}"
        f" / {report.rss_window(0.75, 1.01) / mib:.0f} MiB |",
        f"| every page free afterwards; engine still serving | {pool_full}; {alive} |", "",
        "Result: " + ("**passed**" if not problems and pool_full and alive
                      else "**failed**: " + "; ".join(problems)), ""]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    if not out.exists():
        out.write_text("# Reliability: soak runs of the server\n\n")
    with out.open("a") as handle:
        handle.write(text + "\n")
    return 0 if not problems and pool_full and alive else 1


if __name__ == "__main__":
    sys.exit(main())
