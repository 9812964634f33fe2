"""The gRPC front end: `jaxinfer.v1.Inference`, JetStream's `Orchestrator`, health, reflection.

    server, port = await start_grpc_server(service, "127.0.0.1", 50051)  # port 0: a free one

One `grpc.aio` server on the serving event loop, over the shared `InferenceService`:

* `jaxinfer.v1.Inference` (serve/protos/jaxinfer/v1/inference.proto): `Generate` streams, per
  sample, the text and token ids that are new since the previous message (the engine's
  outputs are cumulative; the deltas are taken here), and the last message carries the finish
  reasons and usage. `Tokenize`, `Detokenize`, `ModelInfo`.
* `jetstream_proto.Orchestrator` (JetStream's wire schema): `Decode` is a greedy request with
  `max_tokens` and `num_samples`; it streams `initial_content`, then `stream_content` deltas.
* `grpc.health.v1.Health`: SERVING for "" and every service while `service.ready` (warm-up is
  done and the engine loop runs), NOT_SERVING otherwise; `Check` reads it live, `Watch`
  streams it (polled every second).
* Server reflection for all of the above (`grpcurl -plaintext HOST:PORT list`).

With an API key, every call except health and reflection (and JetStream's `HealthCheck`)
needs the metadata `authorization: Bearer KEY`. Errors: `InvalidRequestError` is
INVALID_ARGUMENT with a message naming the field, `OverloadedError` RESOURCE_EXHAUSTED,
`UnauthenticatedError` UNAUTHENTICATED, `EngineDeadError` UNAVAILABLE. A cancelled call or an
expired deadline cancels the handler's task; the task leaves `service.generate`, which aborts
the engine request and frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.engine.async_engine import EngineDeadError
from jaxinfer.engine.outputs import CompletionOutput, RequestOutput
from jaxinfer.engine.sampling_params import SamplingParams
from serve.generated.jaxinfer.v1 import inference_pb2 as pb
from serve.generated.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serve.generated.jetstream_proto import jetstream_pb2 as js
from serve.generated.jetstream_proto import jetstream_pb2_grpc as js_grpc
from serve.service import (
    SAMPLING_FIELDS,
    InferenceService,
    InvalidRequestError,
    OverloadedError,
    UnauthenticatedError,
)

logger = logging.getLogger("jaxinfer.serve.grpc")

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ORCHESTRATOR_SERVICE = js.DESCRIPTOR.services_by_name["Orchestrator"].full_name
HEALTH_POLL_SECONDS = 1.0
MAX_REQUEST_ID_LENGTH = 256
_background_tasks: set[asyncio.Future[Any]] = set()

# GenerateRequest's sampling fields that are proto3 `optional` scalars: set means "use this
# value", unset means SamplingParams' default (repeated and map fields have no presence).
_OPTIONAL_FIELDS = tuple(field.name for field in pb.GenerateRequest.DESCRIPTOR.fields
                         if field.has_presence and field.name in SAMPLING_FIELDS)


def _status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details a service error becomes."""
    if isinstance(error, InvalidRequestError):
        field, message = error.field, error.message
        if field is None and "already in use" in message:
            field = "request_id"  # the engine refuses a duplicate id without naming a field
        if field and not message.startswith(field):
            message = f"{field}: {message}"
        return grpc.StatusCode.INVALID_ARGUMENT, message
    if isinstance(error, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(error)
    return grpc.StatusCode.UNAVAILABLE, str(error)


@contextlib.asynccontextmanager
async def _status_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Ends the call with the status of a service error raised inside the block."""
    try:
        yield
    except (InvalidRequestError, OverloadedError, UnauthenticatedError,
            EngineDeadError) as error:
        code, details = _status_of(error)
        await context.abort(code, details)


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The call's `authorization` metadata value, if any (keys arrive lower-cased)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def _position_logprobs(token_id: int, entry: Mapping[int, float] | None,
                       top: int) -> pb.PositionLogprobs:
    """One position's {token: logprob} (the chosen token and the top alternatives) as proto."""
    entry = entry or {}
    ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
    return pb.PositionLogprobs(
        token_id=token_id, logprob=entry.get(token_id, float("nan")),
        top_logprobs=[pb.TokenLogprob(token_id=tid, logprob=lp) for tid, lp in ranked])


class _Deltas:
    """Turns a request's cumulative outputs into per-message deltas."""

    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        self._text_sent: dict[int, int] = {}
        self._tokens_sent: dict[int, int] = {}
        self._finished: set[int] = set()
        self._prompt_logprobs_sent = False

    def sample(self, sample: CompletionOutput) -> tuple[str, list[int], int]:
        """A sample's new text, new token ids and the count of ids sent before, as consumed."""
        text_sent = self._text_sent.get(sample.index, 0)
        tokens_sent = self._tokens_sent.get(sample.index, 0)
        # The engine never takes text back once shown (it holds back possible stop-string
        # prefixes), so the new text is the suffix past what was sent.
        self._text_sent[sample.index] = len(sample.text)
        self._tokens_sent[sample.index] = len(sample.token_ids)
        return sample.text[text_sent:], sample.token_ids[tokens_sent:], tokens_sent

    def response(self, output: RequestOutput) -> pb.GenerateResponse | None:
        """The message for this output; None when nothing changed since the last one."""
        response = pb.GenerateResponse(request_id=output.request_id, finished=output.finished)
        for sample in output.outputs:
            if sample.index in self._finished:
                continue
            text, token_ids, tokens_sent = self.sample(sample)
            if not (text or token_ids or sample.finished):
                continue
            delta = response.outputs.add(index=sample.index, text=text, token_ids=token_ids,
                                         finish_reason=sample.finish_reason or "")
            if self._params.logprobs is not None and sample.logprobs is not None:
                delta.logprobs.extend(
                    _position_logprobs(token, entry, self._params.logprobs)
                    for token, entry in zip(token_ids, sample.logprobs[tokens_sent:]))
            if sample.finished:
                self._finished.add(sample.index)
                if isinstance(sample.stop_reason, str):
                    delta.stop_str = sample.stop_reason
                elif isinstance(sample.stop_reason, int):
                    delta.stop_token_id = sample.stop_reason
        if output.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            self._prompt_logprobs_sent = True
            response.prompt_logprobs.extend(
                _position_logprobs(token, entry, self._params.prompt_logprobs or 0)
                for token, entry in zip(output.prompt_token_ids[1:],
                                        output.prompt_logprobs[1:]))
        if output.finished:
            completion = sum(len(sample.token_ids) for sample in output.outputs)
            prompt = len(output.prompt_token_ids)
            response.usage.CopyFrom(pb.Usage(prompt_tokens=prompt, completion_tokens=completion,
                                             total_tokens=prompt + completion))
        if not (response.outputs or response.prompt_logprobs or output.finished):
            return None
        return response


class _Frontend:
    """Request parsing shared by both services' handlers."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def authorize(self, context: grpc.aio.ServicerContext) -> None:
        """Raises UnauthenticatedError unless the call carries the server's API key."""
        self.service.check_api_key(_authorization(context))

    def request_id(self, given: str) -> str:
        """The client's request id, checked, or a fresh one."""
        if not given:
            return self.service.new_request_id("grpc")
        if len(given) > MAX_REQUEST_ID_LENGTH:
            raise InvalidRequestError("request_id", f"request_id is longer than "
                                                    f"{MAX_REQUEST_ID_LENGTH} characters")
        if "#" in given:
            # The engine names the samples of an n > 1 request "ID#0", "ID#1", ...
            raise InvalidRequestError("request_id", "request_id must not contain '#'")
        return given

    def params(self, fields: Mapping[str, Any], prompt_len: int) -> SamplingParams:
        """Checked SamplingParams; counts a refusal in the metrics."""
        try:
            return self.service.sampling_params(fields, prompt_len)
        except InvalidRequestError:
            self.service.metrics.reject("invalid")
            raise

    def encode(self, prompt: Any, field: str) -> list[int]:
        """Checked prompt token ids; counts a refusal in the metrics."""
        try:
            return self.service.encode_prompt(prompt, field)
        except InvalidRequestError:
            self.service.metrics.reject("invalid")
            raise

    def tokenizer(self) -> Any:
        """The model's tokenizer; InvalidRequestError when it has none."""
        if self.service.tokenizer is None:
            raise InvalidRequestError(None, "this model has no tokenizer; use token ids")
        return self.service.tokenizer

    def check_token_ids(self, token_ids: Iterable[int], field: str) -> list[int]:
        """The ids as a list; InvalidRequestError naming `field` if any is out of range."""
        ids = list(token_ids)
        bad = [token for token in ids if not 0 <= token < self.service.vocab_size]
        if bad:
            raise InvalidRequestError(field, f"{field}: token ids {bad[:5]} are outside the "
                                             f"vocabulary [0, {self.service.vocab_size})")
        return ids


class InferenceServicer(pb_grpc.InferenceServicer):
    """`jaxinfer.v1.Inference` over an `InferenceService`."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service
        self._frontend = _Frontend(service)

    def _parse(self, request: pb.GenerateRequest) -> tuple[Any, SamplingParams, str]:
        """The request's prompt (for the engine), its SamplingParams and its request id."""
        which = request.WhichOneof("prompt")
        if which == "text":
            token_ids = self._frontend.encode(request.text, "text")
            prompt: Any = {"prompt": request.text, "prompt_token_ids": token_ids}
        elif which == "token_ids":
            token_ids = prompt = self._frontend.encode(list(request.token_ids.ids), "token_ids")
        else:
            self._service.metrics.reject("invalid")
            raise InvalidRequestError("prompt", "prompt: the request has no prompt; set text "
                                                "or token_ids")
        fields: dict[str, Any] = {name: getattr(request, name) if request.HasField(name)
                                  else None for name in _OPTIONAL_FIELDS}
        # Repeated and map fields have no presence: empty means not given.
        fields["stop"] = list(request.stop) or None
        fields["stop_token_ids"] = list(request.stop_token_ids) or None
        fields["logit_bias"] = dict(request.logit_bias) or None
        params = self._frontend.params(fields, len(token_ids))
        return prompt, params, self._frontend.request_id(request.request_id)

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 (the RPC's name)
                       context: grpc.aio.ServicerContext) -> None:
        """Streams one request's deltas; see inference.proto."""
        async with _status_errors(context):
            self._frontend.authorize(context)
            prompt, params, request_id = self._parse(request)
            deltas = _Deltas(params)
            # aclosing: when the client cancels or the deadline passes, the CancelledError
            # raised at an await below unwinds through here and closes the stream now, which
            # aborts the engine request (not whenever the generator is garbage collected).
            async with contextlib.aclosing(
                    self._service.generate(prompt, params, request_id)) as stream:
                async for output in stream:
                    response = deltas.response(output)
                    if response is not None:
                        await context.write(response)

    async def Tokenize(self, request: pb.TokenizeRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        """Text to token ids (and their token strings)."""
        async with _status_errors(context):
            self._frontend.authorize(context)
            tokenizer = self._frontend.tokenizer()
            add_special = (request.add_special_tokens
                           if request.HasField("add_special_tokens") else True)
            token_ids = tokenizer.encode(request.text, add_special_tokens=add_special)
            return pb.TokenizeResponse(
                token_ids=token_ids,
                tokens=[tokenizer.id_to_token(token) or "" for token in token_ids])

    async def Detokenize(self, request: pb.DetokenizeRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        """Token ids to text."""
        async with _status_errors(context):
            self._frontend.authorize(context)
            tokenizer = self._frontend.tokenizer()
            token_ids = self._frontend.check_token_ids(request.token_ids, "token_ids")
            skip = (request.skip_special_tokens
                    if request.HasField("skip_special_tokens") else True)
            return pb.DetokenizeResponse(
                text=tokenizer.decode(token_ids, skip_special_tokens=skip))

    async def ModelInfo(self, request: pb.ModelInfoRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        """The served model's name and limits."""
        async with _status_errors(context):
            self._frontend.authorize(context)
            engine = self._service.engine
            tokenizer = self._service.tokenizer
            response = pb.ModelInfoResponse(
                name=self._service.model_name, max_model_len=self._service.max_model_len,
                vocab_size=self._service.vocab_size,
                eos_token_ids=list(engine.model_config.eos_token_ids),
                has_tokenizer=tokenizer is not None,
                max_num_seqs=engine.config.scheduler.max_num_seqs)
            if tokenizer is not None and tokenizer.bos_token_id is not None:
                response.bos_token_id = tokenizer.bos_token_id
            return response


class OrchestratorServicer(js_grpc.OrchestratorServicer):
    """JetStream's `Orchestrator`, so that JetStream clients work unchanged."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service
        self._frontend = _Frontend(service)

    def _prompt(self, request: js.DecodeRequest) -> tuple[Any, list[int]]:
        """The engine prompt and its token ids, with JetStream's BOS rule."""
        which = request.WhichOneof("content")
        if which == "text_content":
            text = request.text_content.text
            if not request.has_bos:
                # JetStream adds BOS to text unless told it is there; our tokenizers add it
                # by default (when the model has one), so the default encoding is that.
                token_ids = self._frontend.encode(text, "text_content.text")
            else:
                # The text already starts with BOS (as a special-token string): add nothing.
                if not text:
                    raise InvalidRequestError("text_content.text", "text_content.text must "
                                                                   "not be empty")
                token_ids = self._frontend.encode(
                    self._frontend.tokenizer().encode(text, add_special_tokens=False),
                    "text_content.text")
            return {"prompt": text, "prompt_token_ids": token_ids}, token_ids
        if which == "token_content":
            # Client-side tokenization: the ids are used as given, BOS included or not.
            token_ids = self._frontend.encode(list(request.token_content.token_ids),
                                              "token_content.token_ids")
            return token_ids, token_ids
        raise InvalidRequestError("content", "content: set text_content or token_content")

    async def Decode(self, request: js.DecodeRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> None:
        """Greedy generation, streamed as JetStream does."""
        async with _status_errors(context):
            self._frontend.authorize(context)
            if request.lora_adapter_id:
                raise InvalidRequestError("lora_adapter_id", "lora_adapter_id: this server "
                                                             "serves no LoRA adapters")
            prompt, token_ids = self._prompt(request)
            params = self._frontend.params(
                {"n": request.num_samples or 1, "temperature": 0.0,
                 "max_tokens": request.max_tokens}, len(token_ids))
            sent = [(0, 0)] * params.n  # per sample: characters and token ids sent
            started = False
            async with contextlib.aclosing(self._service.generate(
                    prompt, params, self._service.new_request_id("jetstream"))) as stream:
                async for output in stream:
                    if not started:
                        # After admission, so a refused request gets its error, not this.
                        started = True
                        await context.write(js.DecodeResponse(
                            initial_content=js.DecodeResponse.InitialContent()))
                    samples = []
                    for sample in output.outputs:
                        text_sent, tokens_sent = sent[sample.index]
                        sent[sample.index] = (len(sample.text), len(sample.token_ids))
                        samples.append(js.DecodeResponse.StreamContent.Sample(
                            text=sample.text[text_sent:],
                            token_ids=sample.token_ids[tokens_sent:]))
                    # Every sample in every message, in order, as JetStream's clients index
                    # them; a step that changed nothing sends nothing.
                    if any(sample.text or sample.token_ids for sample in samples):
                        await context.write(js.DecodeResponse(
                            stream_content=js.DecodeResponse.StreamContent(samples=samples)))

    async def HealthCheck(self, request: js.HealthCheckRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> js.HealthCheckResponse:
        """Live once the engine serves (open, like the standard health service)."""
        return js.HealthCheckResponse(is_live=self._service.ready)


class ReadinessHealthServicer(health.aio.HealthServicer):
    """The standard health service, SERVING exactly while `service.ready`.

    Args:
        service: Whose readiness to report.
        service_names: The fully qualified names reported besides "" (the whole server).
    """

    def __init__(self, service: InferenceService, service_names: Iterable[str]) -> None:
        super().__init__()
        self._service = service
        self._names = ("", *service_names)
        self._status: int | None = None

    async def refresh(self) -> None:
        """Sets every name's status from `service.ready` (wakes `Watch` calls on a change)."""
        status = (health_pb2.HealthCheckResponse.SERVING if self._service.ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if status != self._status:
            self._status = status
            for name in self._names:
                await self.set(name, status)

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        """The current status (read now, not at the last poll)."""
        await self.refresh()
        return await super().Check(request, context)


async def _poll_readiness(servicer: ReadinessHealthServicer) -> NoReturn:
    """Keeps the health status current for `Watch` callers."""
    while True:
        await servicer.refresh()
        await asyncio.sleep(HEALTH_POLL_SECONDS)


async def start_grpc_server(service: InferenceService, host: str, port: int
                            ) -> tuple[grpc.aio.Server, int]:
    """Builds, binds and starts the gRPC server on the running event loop.

    Args:
        service: The engine and request policy to serve.
        host: The interface to bind (an IPv6 address is bracketed here).
        port: The port; 0 picks a free one.

    Returns:
        The started `grpc.aio.Server` (stop it with `await server.stop(grace)`) and the port
        it is bound to.

    Raises:
        RuntimeError: The address could not be bound.
    """
    # so_reuseport off: a second server on a taken port must fail, not share it silently.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(service), server)
    js_grpc.add_OrchestratorServicer_to_server(OrchestratorServicer(service), server)
    health_servicer = ReadinessHealthServicer(service, (INFERENCE_SERVICE, ORCHESTRATOR_SERVICE))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (INFERENCE_SERVICE, ORCHESTRATOR_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
        server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    await server.start()
    await health_servicer.refresh()
    poller = asyncio.ensure_future(_poll_readiness(health_servicer))
    # The poller ends with the server (grpc.aio offers no stop hook, but this wait ends).
    terminated = asyncio.ensure_future(server.wait_for_termination())
    terminated.add_done_callback(lambda _: poller.cancel())
    for task in (poller, terminated):  # the loop holds tasks weakly; keep them alive
        _background_tasks.add(task)
        task.add_done_callback(_background_tasks.discard)
    logger.info("gRPC listening on %s", address.rsplit(":", 1)[0] + f":{bound}")
    return server, bound
