"""A small synchronous Python client for the `jaxinfer.v1.Inference` gRPC service.

    from serve.client import InferenceClient

    with InferenceClient("127.0.0.1:50051", api_key=None) as client:
        client.wait_until_ready(timeout=60)
        for chunk in client.generate("The list type", max_tokens=32, temperature=0):
            print(chunk.outputs[0].text if chunk.outputs else "", end="", flush=True)
        result = client.complete([1, 450, 1051], max_tokens=8)  # token ids work too
        print(result.text, result.finish_reasons, result.completion_tokens)

`generate` yields the server's `GenerateResponse` messages as they arrive (deltas per sample;
the last one has `finished` and `usage`); stopping the iteration early cancels the call, which
aborts the request on the server. Errors arrive as `grpc.RpcError` (`.code()`, `.details()`).

    python -m serve.client 127.0.0.1:50051 "The list type" --max-tokens 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve.generated.jaxinfer.v1 import inference_pb2 as pb
from serve.generated.jaxinfer.v1 import inference_pb2_grpc as pb_grpc

_REQUEST_FIELDS = frozenset(pb.GenerateRequest.DESCRIPTOR.fields_by_name) - {
    "request_id", "text", "token_ids"}


def build_request(prompt: str | Sequence[int], request_id: str | None = None,
                  **sampling: Any) -> pb.GenerateRequest:
    """A `GenerateRequest` from a prompt and SamplingParams-style keyword arguments.

    Args:
        prompt: Text, or a sequence of token ids.
        request_id: Optional; the server picks one when None.
        **sampling: Any SamplingParams field (`max_tokens=16`, `temperature=0`, `stop="\\n"`,
            `logit_bias={5: -100}`, ...); None leaves a field unset (the server's default).

    Raises:
        TypeError: An unknown keyword or a prompt of the wrong type.
    """
    request = pb.GenerateRequest(request_id=request_id or "")
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Sequence):
        request.token_ids.ids.extend(prompt)
        request.token_ids.SetInParent()  # an empty list still selects token_ids
    else:
        raise TypeError(f"prompt must be text or token ids, not {type(prompt).__name__}")
    for name, value in sampling.items():
        if name not in _REQUEST_FIELDS:
            raise TypeError(f"unknown sampling parameter {name!r}; valid: "
                            f"{sorted(_REQUEST_FIELDS)}")
        if value is None:
            continue
        if name == "logit_bias":
            request.logit_bias.update({int(token): float(bias) for token, bias in value.items()})
        elif name == "stop":
            request.stop.extend([value] if isinstance(value, str) else value)
        elif name == "stop_token_ids":
            request.stop_token_ids.extend(value)
        elif name == "structured_outputs":
            request.structured_outputs.CopyFrom(structured_outputs_message(value))
        else:
            setattr(request, name, value)
    return request


def structured_outputs_message(value: Mapping[str, Any]) -> pb.StructuredOutputs:
    """A `StructuredOutputs` message from `SamplingParams.structured_outputs`-style fields
    (`{"json": {...schema...}}`, `{"regex": "..."}`, `{"choice": [...]}`, ...).

    Raises:
        TypeError: An unknown key.
    """
    message = pb.StructuredOutputs()
    for key, item in value.items():
        if item is None:
            continue
        if key == "json":
            message.json = item if isinstance(item, str) else json.dumps(item)
        elif key == "choice":
            message.choice.choices.extend(item)
        elif key in ("json_object", "regex", "grammar", "disable_any_whitespace"):
            setattr(message, key, item)
        else:
            raise TypeError(f"unknown structured_outputs key {key!r}")
    return message


@dataclasses.dataclass
class Completion:
    """A finished generation, assembled from the streamed deltas.

    Attributes:
        request_id: The server's id for the request.
        texts: Full text per sample (index order).
        token_ids: Generated token ids per sample.
        finish_reasons: "stop", "length" or "abort" per sample.
        prompt_tokens: The prompt's token count.
        completion_tokens: Tokens generated over all samples.
    """

    request_id: str
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: int
    completion_tokens: int

    @property
    def text(self) -> str:
        """The first sample's text."""
        return self.texts[0]


class InferenceClient:
    """A channel to a jaxinfer gRPC server and its calls.

    Args:
        target: `HOST:PORT`.
        api_key: Sent as `authorization: Bearer KEY` when given.
        options: Extra channel options (`grpc.insecure_channel`'s).
    """

    def __init__(self, target: str, api_key: str | None = None, *,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self.target = target
        self._channel = grpc.insecure_channel(target, options=list(options))
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    # ------------------------------------------------------------------ generation

    def generate(self, prompt: str | Sequence[int], *, request_id: str | None = None,
                 timeout: float | None = None, **sampling: Any
                 ) -> Iterator[pb.GenerateResponse]:
        """Streams one request's messages.

        Args:
            prompt: Text or token ids.
            request_id: Optional client-chosen id (unique among running requests).
            timeout: Deadline in seconds; past it the server aborts the request.
            **sampling: SamplingParams fields (see `build_request`).

        Yields:
            `GenerateResponse`s: per changed sample, the new text and token ids; the last has
            `finished`, the finish reasons and `usage`.

        Raises:
            grpc.RpcError: The server refused or failed the call.
        """
        request = build_request(prompt, request_id, **sampling)
        call = self._stub.Generate(request, metadata=self._metadata, timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once finished; else the server aborts the request

    def complete(self, prompt: str | Sequence[int], *, request_id: str | None = None,
                 timeout: float | None = None, **sampling: Any) -> Completion:
        """Runs one request to the end and returns the assembled output."""
        texts: dict[int, list[str]] = {}
        token_ids: dict[int, list[int]] = {}
        reasons: dict[int, str] = {}
        last = pb.GenerateResponse()
        for chunk in self.generate(prompt, request_id=request_id, timeout=timeout,
                                   **sampling):
            for delta in chunk.outputs:
                texts.setdefault(delta.index, []).append(delta.text)
                token_ids.setdefault(delta.index, []).extend(delta.token_ids)
                if delta.finish_reason:
                    reasons[delta.index] = delta.finish_reason
            last = chunk
        indices = sorted(texts)
        return Completion(last.request_id, ["".join(texts[i]) for i in indices],
                          [token_ids[i] for i in indices], [reasons.get(i, "") for i in indices],
                          last.usage.prompt_tokens, last.usage.completion_tokens)

    # ------------------------------------------------------------------ the rest

    def tokenize(self, text: str, add_special_tokens: bool = True,
                 timeout: float | None = None) -> list[int]:
        """The server tokenizer's ids for `text`."""
        response = self._stub.Tokenize(
            pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
            metadata=self._metadata, timeout=timeout)
        return list(response.token_ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
                   timeout: float | None = None) -> str:
        """The server tokenizer's text for `token_ids`."""
        response = self._stub.Detokenize(
            pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens),
            metadata=self._metadata, timeout=timeout)
        return response.text

    def model_info(self, timeout: float | None = None) -> pb.ModelInfoResponse:
        """The served model's name, context length, vocabulary size and EOS ids."""
        return self._stub.ModelInfo(pb.ModelInfoRequest(), metadata=self._metadata,
                                    timeout=timeout)

    def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """Whether the server reports SERVING (False while warming up or unreachable)."""
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                          timeout=timeout)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.25) -> None:
        """Polls `health()` until SERVING.

        Raises:
            TimeoutError: Not SERVING within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self.health(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.target} was not SERVING within {timeout} s")
            time.sleep(interval)

    def close(self) -> None:
        """Closes the channel (open calls are cancelled)."""
        self._channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m serve.client TARGET PROMPT`: streams one generation to stdout."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("target", help="HOST:PORT of the gRPC server")
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for the server to be SERVING first")
    args = parser.parse_args(argv)
    with InferenceClient(args.target, api_key=args.api_key) as client:
        if args.wait:
            client.wait_until_ready(args.wait)
        for chunk in client.generate(args.prompt, max_tokens=args.max_tokens,
                                     temperature=args.temperature):
            for delta in chunk.outputs:
                sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
