"""The two streaming clients `jaxinfer bench serve` times: OpenAI HTTP and our gRPC service.

Each sends one greedy request that must generate exactly `output_len` tokens (`ignore_eos`),
streams the answer and records when each chunk arrived. A request that fails (an HTTP or
gRPC error, a dropped connection) is recorded with its error rather than raised, so one
refusal (429 under overload) does not stop the load.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import time
from typing import Any


@dataclasses.dataclass
class RequestResult:
    """What one request measured.

    Attributes:
        prompt_tokens: Prompt length the server reported.
        output_tokens: Tokens generated.
        ttft_s: Seconds from sending to the first generated token (None: none came).
        itl_s: Seconds between consecutive token-bearing chunks.
        latency_s: Seconds from sending to the end of the stream.
        error: None, or a short description of the failure.
    """

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    latency_s: float = 0.0
    error: str | None = None


class _Timer:
    """Records chunk arrival times of one stream."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.started = time.perf_counter()
        self.last: float | None = None

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft_s = now - self.started
        else:
            self.result.itl_s.append(now - self.last)
        self.last = now

    def done(self) -> RequestResult:
        self.result.latency_s = time.perf_counter() - self.started
        return self.result


class StreamClient(abc.ABC):
    """A load-test client of one server.

    Args:
        host: Server host.
        port: Server port.
        model: Model name to send (None: the server's, from `model_info`).
        api_key: Sent as `authorization: Bearer KEY` when given.
    """

    def __init__(self, host: str, port: int, model: str | None, api_key: str | None) -> None:
        self.host, self.port, self.model, self.api_key = host, port, model, api_key

    @abc.abstractmethod
    async def model_info(self) -> dict[str, Any]:
        """{"name", "vocab_size", "max_model_len"} of the served model."""

    @abc.abstractmethod
    async def request(self, prompt: str | list[int], output_len: int) -> RequestResult:
        """Streams one request and times it."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases connections."""


class OpenAIClient(StreamClient):
    """Streaming `POST /v1/completions`, usage from the final chunk."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._session: Any = None

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _http(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                f"http://{self.host}:{self.port}", headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=None),
                connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def model_info(self) -> dict[str, Any]:
        session = await self._http()
        async with session.get("/v1/models") as response:
            response.raise_for_status()
            model = (await response.json())["data"][0]
        self.model = self.model or model["id"]
        return {"name": self.model, "vocab_size": model.get("vocab_size"),
                "max_model_len": model.get("max_model_len")}

    async def request(self, prompt: str | list[int], output_len: int) -> RequestResult:
        session = await self._http()
        result = RequestResult()
        timer = _Timer(result)
        body = {"model": self.model, "prompt": prompt, "max_tokens": output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            async with session.post("/v1/completions", json=body) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}"
                    return timer.done()
                async for raw in response.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        timer.chunk()
                    if chunk.get("usage"):
                        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        result.output_tokens = chunk["usage"]["completion_tokens"]
        except Exception as error:  # a dropped connection counts as a failed request
            result.error = type(error).__name__
        return timer.done()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class GrpcClient(StreamClient):
    """Streaming `jaxinfer.v1.Inference/Generate` over one grpc.aio channel."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._channel: Any = None
        self._stub: Any = None

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def _connect(self) -> Any:
        import grpc

        from serve.generated.jaxinfer.v1 import inference_pb2_grpc

        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(f"{self.host}:{self.port}")
            self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        return self._stub

    async def model_info(self) -> dict[str, Any]:
        from serve.generated.jaxinfer.v1 import inference_pb2

        info = await self._connect().ModelInfo(inference_pb2.ModelInfoRequest(),
                                               metadata=self._metadata())
        self.model = self.model or info.name
        return {"name": self.model, "vocab_size": info.vocab_size,
                "max_model_len": info.max_model_len}

    async def request(self, prompt: str | list[int], output_len: int) -> RequestResult:
        import grpc

        from serve.generated.jaxinfer.v1 import inference_pb2

        result = RequestResult()
        timer = _Timer(result)
        if isinstance(prompt, str):
            message = inference_pb2.GenerateRequest(text=prompt)
        else:
            message = inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=prompt))
        message.max_tokens, message.temperature, message.ignore_eos = output_len, 0.0, True
        try:
            async for response in self._connect().Generate(message, metadata=self._metadata()):
                if any(sample.token_ids for sample in response.outputs):
                    timer.chunk()
                if response.finished:
                    result.prompt_tokens = response.usage.prompt_tokens
                    result.output_tokens = response.usage.completion_tokens
        except grpc.aio.AioRpcError as error:
            result.error = error.code().name
        return timer.done()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


CLIENTS: dict[str, type[StreamClient]] = {"openai": OpenAIClient, "grpc": GrpcClient}
