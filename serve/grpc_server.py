"""The gRPC front end: `jaxinfer.v1.Inference`, JetStream's `Orchestrator`, health, reflection.

    server, port = await start_grpc_server(service, "127.0.0.1", 50051)  # port 0: a free one

One `grpc.aio` server on the serving event loop, over the shared `InferenceService`:

* `jaxinfer.v1.Inference` (serve/protos/jaxinfer/v1/inference.proto): `Generate` streams, per
  sample, the text and token ids that are new since the previous message (the engine's DELTA
  outputs, as they come), and the last message carries the finish reasons and usage. Every
  `GenerateRequest` field named like a `SamplingParams` field is passed on as that field.
  A client may name its request (`request_id`, shown back unchanged); the engine keeps client
  ids in their own namespace, so they never collide with the server's own (`grpc-N`).
  `Tokenize`, `Detokenize`, `ModelInfo`.
* `jetstream_proto.Orchestrator` (JetStream's wire schema): `Decode` is a greedy request with
  `max_tokens` and `num_samples`; it streams `initial_content`, then `stream_content` deltas.
* `grpc.health.v1.Health`: SERVING for "" and every service while `service.ready` (warm-up is
  done and the engine loop runs), NOT_SERVING otherwise; `Check` reads it live, `Watch`
  streams it (polled every second).
* Server reflection for all of the above (`grpcurl -plaintext HOST:PORT list`).

With an API key, every call except health and reflection (and JetStream's `HealthCheck`)
needs the metadata `authorization: Bearer KEY`. Errors: a `RequestError` (the engine's checks
and the service's) is INVALID_ARGUMENT with a message starting with the field,
`OverloadedError` RESOURCE_EXHAUSTED, `UnauthenticatedError` UNAUTHENTICATED,
`EngineDeadError` UNAVAILABLE, `RequestFailedError` (the engine failed on this request alone)
INTERNAL. A cancelled call or an expired deadline cancels the handler's task; the task leaves
`service.generate`, which aborts the engine request and frees its pages. So does a client that
stops reading a stream: once one `context.write` has waited `write_timeout_seconds` (flow
control holds it), the call ends with DEADLINE_EXCEEDED. Health turns NOT_SERVING as soon as the
engine loop dies (not at the next poll), before the server stops.
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
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.outputs import RequestOutput
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
    RequestFailedError,
    SlowClientError,
    UnauthenticatedError,
)

logger = logging.getLogger("jaxinfer.serve.grpc")

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ORCHESTRATOR_SERVICE = js.DESCRIPTOR.services_by_name["Orchestrator"].full_name
HEALTH_POLL_SECONDS = 1.0
MAX_REQUEST_ID_LENGTH = 256
_background_tasks: set[asyncio.Future[Any]] = set()

# GenerateRequest's fields named like SamplingParams fields: each is passed on as that field.
_SAMPLING_DESCRIPTORS = tuple(field for field in pb.GenerateRequest.DESCRIPTOR.fields
                              if field.name in SAMPLING_FIELDS)


def _structured_outputs(message: pb.StructuredOutputs) -> dict[str, Any]:
    """A `StructuredOutputs` message as `SamplingParams.structured_outputs` fields (an unset
    kind gives none, which SamplingParams refuses, naming the field)."""
    kind = message.WhichOneof("kind")
    fields: dict[str, Any] = {"disable_any_whitespace": message.disable_any_whitespace}
    if kind == "choice":
        fields["choice"] = list(message.choice.choices)
    elif kind is not None:
        fields[kind] = getattr(message, kind)
    return fields


def _sampling_fields(request: pb.GenerateRequest) -> dict[str, Any]:
    """The request's sampling fields as plain values; None where not given (an unset proto3
    `optional` scalar or message, or an empty repeated or map field, which have no
    presence)."""
    fields: dict[str, Any] = {}
    for field in _SAMPLING_DESCRIPTORS:
        value = getattr(request, field.name)
        if field.name == "structured_outputs":
            fields[field.name] = (_structured_outputs(value)
                                  if request.HasField(field.name) else None)
        elif field.has_presence:
            fields[field.name] = value if request.HasField(field.name) else None
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            fields[field.name] = dict(value) or None
        elif field.is_repeated:
            fields[field.name] = list(value) or None
        else:
            fields[field.name] = value
    return fields


def _status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details a service error becomes."""
    if isinstance(error, RequestError):
        field, message = error.field, error.message
        if field and not message.startswith(field):
            message = f"{field}: {message}"
        return grpc.StatusCode.INVALID_ARGUMENT, message
    if isinstance(error, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(error)
    if isinstance(error, RequestFailedError):
        return grpc.StatusCode.INTERNAL, str(error)
    if isinstance(error, SlowClientError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    return grpc.StatusCode.UNAVAILABLE, str(error)


@contextlib.asynccontextmanager
async def _status_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Ends the call with the status of a service error raised inside the block."""
    try:
        yield
    except (RequestError, OverloadedError, UnauthenticatedError, EngineDeadError,
            RequestFailedError, SlowClientError) as error:
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


def _response(output: RequestOutput, params: SamplingParams, generated: int,
              request_id: str) -> pb.GenerateResponse:
    """The message for one DELTA output; `generated` counts the request's tokens so far (the
    usage of the last message), `request_id` is the id the client knows the request by."""
    response = pb.GenerateResponse(request_id=request_id, finished=output.finished)
    for sample in output.outputs:
        delta = response.outputs.add(index=sample.index, text=sample.text,
                                     token_ids=sample.token_ids,
                                     finish_reason=sample.finish_reason or "")
        if params.logprobs is not None and sample.logprobs is not None:
            delta.logprobs.extend(_position_logprobs(token, entry, params.logprobs)
                                  for token, entry in zip(sample.token_ids, sample.logprobs))
        if isinstance(sample.stop_reason, str):
            delta.stop_str = sample.stop_reason
        elif isinstance(sample.stop_reason, int):
            delta.stop_token_id = sample.stop_reason
    if output.prompt_logprobs is not None:  # a DELTA output carries them once
        response.prompt_logprobs.extend(
            _position_logprobs(token, entry, params.prompt_logprobs or 0)
            for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]))
    if output.finished:
        prompt = len(output.prompt_token_ids)
        response.usage.CopyFrom(pb.Usage(prompt_tokens=prompt, completion_tokens=generated,
                                         total_tokens=prompt + generated))
    return response


class _Frontend:
    """Request parsing shared by both services' handlers."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def authorize(self, context: grpc.aio.ServicerContext) -> None:
        """Raises UnauthenticatedError unless the call carries the server's API key."""
        self.service.check_api_key(_authorization(context))

    def request_id(self, given: str) -> tuple[str, str]:
        """The request's id as the client sees it and as the engine does.

        The client's id, checked, or a fresh `grpc-N`. A client's id is namespaced inside the
        engine (`InferenceService.client_request_id`), so it never collides with one the
        server made; the client sees it unchanged.
        """
        if not given:
            request_id = self.service.new_request_id("grpc")
            return request_id, request_id
        if len(given) > MAX_REQUEST_ID_LENGTH:
            raise InvalidRequestError("request_id", f"request_id is longer than "
                                                    f"{MAX_REQUEST_ID_LENGTH} characters")
        if "#" in given:
            # The engine names the samples of an n > 1 request "ID#0", "ID#1", ...
            raise InvalidRequestError("request_id", "request_id must not contain '#'")
        return given, self.service.client_request_id(given)

    def tokenizer(self) -> Any:
        """The model's tokenizer; InvalidRequestError when it has none."""
        if self.service.tokenizer is None:
            raise InvalidRequestError(None, "this model has no tokenizer; use token ids")
        return self.service.tokenizer


class InferenceServicer(pb_grpc.InferenceServicer):
    """`jaxinfer.v1.Inference` over an `InferenceService`."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service
        self._frontend = _Frontend(service)

    def _parse(self, request: pb.GenerateRequest
               ) -> tuple[Any, SamplingParams, tuple[str, str]]:
        """The request's prompt (for the engine), its SamplingParams and its request id (as
        the client sees it, and as the engine does)."""
        which = request.WhichOneof("prompt")
        if which == "text":
            token_ids = self._service.encode_prompt(request.text, "text")
            prompt: Any = {"prompt": request.text, "prompt_token_ids": token_ids}
        elif which == "token_ids":
            token_ids = prompt = self._service.encode_prompt(list(request.token_ids.ids),
                                                             "token_ids")
        else:
            self._service.metrics.reject("invalid")
            raise InvalidRequestError("prompt", "prompt: the request has no prompt; set text "
                                                "or token_ids")
        params = self._service.sampling_params(_sampling_fields(request), len(token_ids))
        return prompt, params, self._frontend.request_id(request.request_id)

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 (the RPC's name)
                       context: grpc.aio.ServicerContext) -> None:
        """Streams one request's deltas; see inference.proto."""
        async with _status_errors(context):
            self._frontend.authorize(context)
            prompt, params, (shown_id, engine_id) = self._parse(request)
            generated = 0
            # aclosing: when the client cancels or the deadline passes, the CancelledError
            # raised at an await below unwinds through here and closes the stream now, which
            # aborts the engine request (not whenever the generator is garbage collected).
            try:
                async with contextlib.aclosing(
                        self._service.generate(prompt, params, engine_id)) as stream:
                    async for output in stream:
                        generated += sum(len(sample.token_ids) for sample in output.outputs)
                        await self._service.write(context.write(
                            _response(output, params, generated, shown_id)))
            except RequestError as error:
                if error.field != "request_id":
                    raise
                # Quote the id the client sent, not its engine-side name.
                raise InvalidRequestError("request_id", f"request_id {shown_id!r} is "
                                                        "already in use") from None

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
            token_ids = self._service.check_token_ids(request.token_ids, "token_ids")
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
                token_ids = self._service.encode_prompt(text, "text_content.text")
            else:
                # The text already starts with BOS (as a special-token string): add nothing.
                if not text:
                    raise InvalidRequestError("text_content.text", "text_content.text must "
                                                                   "not be empty")
                token_ids = self._service.encode_prompt(
                    self._frontend.tokenizer().encode(text, add_special_tokens=False),
                    "text_content.text")
            return {"prompt": text, "prompt_token_ids": token_ids}, token_ids
        if which == "token_content":
            # Client-side tokenization: the ids are used as given, BOS included or not.
            token_ids = self._service.encode_prompt(list(request.token_content.token_ids),
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
            params = self._service.sampling_params(
                {"n": request.num_samples or 1, "temperature": 0.0,
                 "max_tokens": request.max_tokens}, len(token_ids))
            started = False
            async with contextlib.aclosing(self._service.generate(
                    prompt, params, self._service.new_request_id("jetstream"))) as stream:
                async for output in stream:
                    if not started:
                        # After admission, so a refused request gets its error, not this.
                        started = True
                        await self._service.write(context.write(js.DecodeResponse(
                            initial_content=js.DecodeResponse.InitialContent())))
                    new = {sample.index: sample for sample in output.outputs}
                    samples = [js.DecodeResponse.StreamContent.Sample(
                        text=new[index].text, token_ids=new[index].token_ids)
                        if index in new else js.DecodeResponse.StreamContent.Sample()
                        for index in range(params.n)]
                    # Every sample in every message, in order, as JetStream's clients index
                    # them; a step that changed nothing sends nothing.
                    if any(sample.text or sample.token_ids for sample in samples):
                        await self._service.write(context.write(js.DecodeResponse(
                            stream_content=js.DecodeResponse.StreamContent(samples=samples))))

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


def _keep(task: asyncio.Future[Any]) -> None:
    """Holds a background task until it is done (the event loop holds tasks weakly)."""
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)


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
    loop = asyncio.get_running_loop()

    def engine_stopped(_: Any) -> None:  # on the engine thread, as its loop ends
        with contextlib.suppress(RuntimeError):  # the serving loop is closed already
            loop.call_soon_threadsafe(
                lambda: _keep(asyncio.ensure_future(health_servicer.refresh())))

    service.engine.stopped.add_done_callback(engine_stopped)
    poller = asyncio.ensure_future(_poll_readiness(health_servicer))
    # The poller ends with the server (grpc.aio offers no stop hook, but this wait ends).
    terminated = asyncio.ensure_future(server.wait_for_termination())
    terminated.add_done_callback(lambda _: poller.cancel())
    for task in (poller, terminated):
        _keep(task)
    logger.info("gRPC listening on %s", address.rsplit(":", 1)[0] + f":{bound}")
    return server, bound
