"""The serving report: `jaxinfer bench serve` against a real `jaxinfer serve`, both front ends.

    python benchmarks/serving_load.py --out benchmarks/results/serving.md

Starts `jaxinfer serve --model builtin:demo` on free loopback ports (`serve.launcher`),
waits until /health answers 200, then runs `jaxinfer bench serve` for the OpenAI HTTP front
end and the gRPC front end at each request rate (same prompts, same seed), appending each
run's section to the report; finally stops the server with SIGTERM and checks it exited 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from serve.launcher import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    """Runs the load matrix and writes the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/serving.md")
    parser.add_argument("--rates", default="2,8,inf", help="request rates, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()
    jaxinfer = [sys.executable, "-m", "jaxinfer.cli"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    options = ("--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", "512",
               "--no-prompt-logprobs")
    out.write_text(
        "# Serving load: `jaxinfer bench serve` against `jaxinfer serve` on the demo model\n\n"
        f"Reproduce: `python benchmarks/serving_load.py --out {args.out}` (starts "
        f"`jaxinfer serve --model builtin:demo {' '.join(options)}` on free loopback ports, "
        "then runs each front end at each rate).\n\n"
        f"{args.num_prompts} requests per run, random prompts of {args.input_len} token ids, "
        f"exactly {args.output_len} output tokens each (greedy, EOS ignored), streaming; "
        "client and server share this machine's 2 vCPUs, so the client's own cost is in the "
        "numbers. Times in milliseconds.\n\n")
    server = ServerProcess("builtin:demo", *options)
    with server:
        for backend, port in (("openai", server.http_port), ("grpc", server.grpc_port)):
            subprocess.run(
                [*jaxinfer, "bench", "serve", "--backend", backend, "--port", str(port),
                 "--num-prompts", str(args.num_prompts), "--random-input-len",
                 str(args.input_len), "--random-output-len", str(args.output_len),
                 "--request-rate", *args.rates.split(","), "--markdown", str(out)],
                cwd=ROOT, check=True)
    print(f"server exited with {server.exit_code}")
    return 0 if server.exit_code == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
