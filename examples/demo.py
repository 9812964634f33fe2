"""`make demo`: serve the built-in demo model and generate through both front ends.

1. starts `jaxinfer serve --model builtin:demo` on free loopback ports and waits until it is
   healthy (the engine compiles its step shapes first);
2. streams one generation through the gRPC client (`serve.client.InferenceClient`);
3. streams one through the OpenAI-compatible HTTP API (`POST /v1/completions`, server-sent
   events, read here with nothing but the standard library);
4. stops the server with SIGTERM and checks that it exited cleanly.

The demo model (`builtin:demo`, 8.4M parameters) was trained by this repository's
`train_distill` on the Python 3.11 documentation and ships in `jaxinfer/builtin_models/demo/`.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

from serve.client import InferenceClient
from serve.launcher import ServerProcess

GRPC_PROMPT = "The list type is"
HTTP_PROMPT = "To open a file, use the"
ENGINE_OPTIONS = ("--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                  "--max-model-len", "256", "--no-prompt-logprobs")


def stream_grpc(port: int) -> None:
    """One streaming greedy request through gRPC, printed as it arrives."""
    with InferenceClient(f"127.0.0.1:{port}") as client:
        print(f"\n[gRPC jaxinfer.v1.Inference/Generate] {GRPC_PROMPT}", end="", flush=True)
        for chunk in client.generate(GRPC_PROMPT, max_tokens=48, temperature=0.0):
            for delta in chunk.outputs:
                print(delta.text, end="", flush=True)
            if chunk.finished:
                print(f"\n  ({chunk.usage.prompt_tokens} prompt + "
                      f"{chunk.usage.completion_tokens} generated tokens, finish reason "
                      f"{chunk.outputs[0].finish_reason!r})")


def stream_http(port: int) -> None:
    """One streaming greedy request through the OpenAI-compatible API, printed as it arrives."""
    body = json.dumps({"model": "builtin:demo", "prompt": HTTP_PROMPT, "max_tokens": 48,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"content-type": "application/json"})
    print(f"\n[HTTP POST /v1/completions, stream] {HTTP_PROMPT}", end="", flush=True)
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            for choice in chunk.get("choices", []):
                print(choice.get("text", ""), end="", flush=True)
            if chunk.get("usage"):
                usage = chunk["usage"]
                print(f"\n  ({usage['prompt_tokens']} prompt + "
                      f"{usage['completion_tokens']} generated tokens)")


def main() -> int:
    """Runs the demo; returns the exit status."""
    print("$ jaxinfer serve --model builtin:demo " + " ".join(ENGINE_OPTIONS), flush=True)
    started = time.perf_counter()
    server = ServerProcess("builtin:demo", *ENGINE_OPTIONS, ready_timeout_s=900)
    with server:
        print(f"server healthy after {time.perf_counter() - started:.0f} s "
              f"(gRPC :{server.grpc_port}, HTTP :{server.http_port})", flush=True)
        stream_grpc(server.grpc_port)
        stream_http(server.http_port)
        print("\nstopping the server (SIGTERM)", flush=True)
    print(f"server exited with status {server.exit_code}")
    return 0 if server.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
