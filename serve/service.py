"""What both front ends share: request checks, admission, the API key, metrics, generation.

A front end (gRPC or HTTP) parses its wire format into plain Python values, then calls:

    service.check_api_key(authorization_header)          # UnauthenticatedError
    token_ids = service.encode_prompt(prompt, "prompt")    # RequestError(field, message)
    params = service.sampling_params(fields, len(token_ids))  # RequestError(field, message)
    async for output in service.generate(prompt, params, request_id):  # OverloadedError
        ...                                                # DELTA RequestOutputs

and maps the errors to its status codes (UNAUTHENTICATED / 401, INVALID_ARGUMENT / 400,
RESOURCE_EXHAUSTED / 429). The request checks are the engine's (`InputProcessor`,
`SamplingParams`): everything refused (an empty prompt, unknown token ids, a prompt that fills
the context, a value out of range) is a `jaxinfer.engine.errors.RequestError` whose `field`
names the field, so a front end maps `.field` to its wire name and never parses messages.
Only what the engine cannot know is checked here: the wire types of the fields, unknown field
names, and max_tokens' default and bound by the context. Nothing refused is queued, so the
requests already running never notice.

The servers ask for `RequestOutputKind.DELTA` outputs and stream them as they come.

Two timeouts bound what one request can hold (`ServiceConfig`): `max_request_seconds` aborts
a request that runs longer (its last output has finish_reason "abort"), and
`write_timeout_seconds` bounds each streamed write (`write`): a client that stops reading
fills its socket buffer, the write cannot complete, and the front end drops the call, which
aborts the request and frees its pages. A request the engine failed on alone (its output
carries an `error`) raises `RequestFailedError` from `generate`; the others carry on.

Admission is a bound on sequences that have not yet been admitted to the engine's running set
(a request with n samples counts n): when `max_queued_requests` are already waiting, a new one
is refused at once rather than queued behind minutes of work (the client can retry elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import logging
import types
import typing
from collections import abc
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.core import Prompt
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.input_processor import InputProcessor
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from serve.metrics import ServingMetrics
from serve.tool_parsers import get_tool_parser

# A request field is wrong: the engine's own error, raised by the serve-side checks too, so a
# front end catches one type and maps its `field` to a wire name.
InvalidRequestError = RequestError


class OverloadedError(RuntimeError):
    """The waiting queue is full; retry later."""


class UnauthenticatedError(PermissionError):
    """The call lacks the server's API key."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request alone (a server error, HTTP 500 / gRPC INTERNAL);
    every other request carries on."""


class SlowClientError(ConnectionError):
    """A streamed write did not complete within `write_timeout_seconds`: the client stopped
    reading. The front end drops the connection (nobody can be told)."""


logger = logging.getLogger("jaxinfer.serve")


# SamplingParams fields a server does not let a request set (it decides them itself).
_SERVER_FIELDS = frozenset({"output_kind"})


def _wire_types(annotation: Any) -> tuple[type, ...]:
    """The JSON / proto Python types a SamplingParams annotation accepts on the wire: a
    float takes ints too, a sequence is a list, an optional value is its non-None types."""
    members = typing.get_args(annotation) if isinstance(
        annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union \
        else (annotation,)
    wire: list[type] = []
    for member in members:
        origin = typing.get_origin(member) or member
        if member is type(None):
            continue
        if member is float:
            wire += [int, float]
        elif isinstance(origin, type) and issubclass(origin, abc.Sequence) \
                and not issubclass(origin, str):
            wire.append(list)
        elif isinstance(origin, type) and issubclass(origin, abc.Mapping):
            wire.append(dict)
        else:
            wire.append(origin)
    return tuple(dict.fromkeys(wire))


# SamplingParams fields a request may set, with the Python types each accepts on the wire
# (derived from the dataclass, so a new sampling parameter needs no edit here).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    field.name: _wire_types(typing.get_type_hints(SamplingParams)[field.name])
    for field in dataclasses.fields(SamplingParams) if field.name not in _SERVER_FIELDS}
SAMPLING_FIELDS = tuple(_FIELD_TYPES)

# Text longer than this is tokenized (and chats longer than this rendered) off the event loop;
# shorter text costs less than the hop to a worker thread.
OFF_LOOP_CHARS = 4096

# The engine ids of client-chosen request ids start with this; server-made ids never do.
CLIENT_ID_PREFIX = "client:"

# The request id the engine's checks quote when a request is checked before it has one.
_CHECK_ID = "new"


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """Server-wide request policy.

    Attributes:
        model_name: The name clients address the model by (`/v1/models`, `ModelInfo`).
        max_queued_requests: Sequences (n per request) allowed to wait for admission before
            new requests get RESOURCE_EXHAUSTED / 429.
        api_key: If set, every call must carry `authorization: Bearer <api_key>`.
        chat_template: Jinja source for chat requests; None uses the tokenizer's own.
        allowed_hosts: HTTP `Host` names served (`serve.access`); None: the loopback names
            when bound to loopback, any host otherwise.
        allowed_origins: Browser origins allowed to call over HTTP; none by default.
        max_request_seconds: A request still running this long after it arrived is aborted
            (finish_reason "abort"); None: no limit.
        write_timeout_seconds: Longest wait for one streamed write (HTTP chunk, gRPC
            message) to be taken by the client before the call is dropped and its request
            aborted; None: no limit.
        vllm_metrics: `/metrics` also exports vLLM's names (`vllm:*`, vLLM's labels) beside
            ours, so dashboards built for vLLM work unchanged (`serve.metrics`).
        tool_call_parser: The model's tool-call format (`serve.tool_parsers`: "hermes",
            "llama3_json", "mistral"), for `tool_choice: "auto"`; None: no parser.
        enable_auto_tool_choice: Serve `tool_choice: "auto"` (needs `tool_call_parser`);
            otherwise it is a 400, as in vLLM. "required" and named choices need neither.
        exclude_tools_when_tool_choice_none: Leave the tools out of the prompt when
            `tool_choice` is "none" (by default they are rendered, as in vLLM).
    """

    model_name: str
    max_queued_requests: int = 256
    api_key: str | None = None
    chat_template: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    max_request_seconds: float | None = 600.0
    write_timeout_seconds: float | None = 30.0
    vllm_metrics: bool = True
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming the known parsers
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs a "
                             "tool_call_parser (--tool-call-parser): the format of the "
                             "model's tool calls")
        for name in ("max_request_seconds", "write_timeout_seconds"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} = {value!r}: must be > 0 (or None: no limit)")


class InferenceService:
    """The engine plus the policy around it; one per server process.

    Args:
        engine: A started (or about to be started) `AsyncEngine`.
        config: Names, limits and the API key.
    """

    def __init__(self, engine: AsyncEngine, config: ServiceConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServingMetrics(engine.stats, config.model_name,
                                      vllm_names=config.vllm_metrics,
                                      max_model_len=engine.max_model_len)
        self._ids = itertools.count()
        self._not_admitted = 0  # requests inside generate() that have produced nothing yet
        # The engine's own request checks (stateless, so usable on the serving thread).
        self._inputs = InputProcessor(engine.model_config, engine.config, engine.tokenizer)
        self._expiring: set[asyncio.Future[Any]] = set()  # aborts of requests out of time

    # ------------------------------------------------------------------ facts

    @property
    def model_name(self) -> str:
        """The served model's public name."""
        return self.config.model_name

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (None for a token-ids-only model)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the engine serves."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""
        return self.engine.model_config.vocab_size

    @property
    def ready(self) -> bool:
        """True once warm-up is done and the engine loop runs (health: SERVING)."""
        return self.engine.is_running

    # ------------------------------------------------------------------ checks

    def check_api_key(self, authorization: str | None) -> None:
        """Accepts `Bearer <key>` (or anything when no key is configured).

        Raises:
            UnauthenticatedError: A key is configured and `authorization` does not carry it.
        """
        expected = self.config.api_key
        if expected is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        # Bytes, not str: compare_digest refuses non-ASCII str (a TypeError, so a 500), and a
        # header decoded with surrogateescape may hold lone surrogates (hence surrogatepass).
        given = token.strip().encode("utf-8", "surrogatepass")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected.encode()):
            self.metrics.reject("unauthenticated")
            raise UnauthenticatedError("missing or wrong API key: send the header "
                                       "'authorization: Bearer <key>'")

    def _engine_check(self, field: str, check: typing.Callable[[], Any]) -> Any:
        """Runs one of the engine's checks; its "prompt" errors are renamed to `field` (the
        prompt's wire name), and every refusal is counted."""
        try:
            return check()
        except RequestError as error:
            self.metrics.reject("invalid")
            if error.field == "prompt" and field != "prompt":
                raise InvalidRequestError(field, f"{field}: {error.message}") from None
            raise

    def encode_prompt(self, prompt: Any, field: str = "prompt") -> list[int]:
        """Text or token ids to a checked, non-empty list of token ids (the engine's checks).

        Raises:
            RequestError: On `field`: empty, of the wrong type, ids outside the vocabulary,
                text without a tokenizer, or no room for output within max_model_len.
        """
        if prompt == "":
            self.metrics.reject("invalid")
            raise InvalidRequestError(field, f"{field} must not be empty")

        def check() -> list[int]:
            _, token_ids = self._inputs.tokenize(_CHECK_ID, prompt)
            self._inputs.validate_prompt(_CHECK_ID, token_ids)
            return token_ids

        return self._engine_check(field, check)

    def check_prompt_chars(self, text: str, field: str = "prompt") -> None:
        """Refuses text too long to fit the context, before tokenizing it.

        Raises:
            RequestError: On `field`.
        """
        self._engine_check(field, lambda: self._inputs.check_prompt_chars(_CHECK_ID, text,
                                                                           field))

    async def encode_prompt_async(self, prompt: Any, field: str = "prompt") -> list[int]:
        """`encode_prompt` for the event loop: a long text is tokenized in a worker thread,
        so one large prompt does not stall every other client's stream (the tokenizers
        release the GIL while they encode)."""
        if isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS:
            self.check_prompt_chars(prompt, field)
            return await asyncio.to_thread(self.encode_prompt, prompt, field)
        return self.encode_prompt(prompt, field)

    def check_prompt_count(self, count: int, field: str = "prompt") -> None:
        """The number of prompts one request may carry (`RequestLimits`).

        Raises:
            RequestError: On `field`.
        """
        self._engine_check(field, lambda: self.engine.config.limits.check_prompts(count, field))

    def check_token_ids(self, token_ids: abc.Iterable[int], field: str) -> list[int]:
        """The ids as a list, each inside the vocabulary (the engine's check)."""
        ids = list(token_ids)
        self._engine_check(field, lambda: self._inputs.check_token_ids(
            _CHECK_ID, field, field, ids))
        return ids

    def sampling_params(self, fields: Mapping[str, Any], prompt_len: int,
                        default_max_tokens: int | None = 16) -> SamplingParams:
        """Checks wire fields and builds SamplingParams that ask for DELTA outputs.

        The serve-only checks are here (wire types, unknown names, max_tokens' default and
        its bound by the context); the values are checked by SamplingParams and the engine.

        Args:
            fields: SamplingParams field names to values; None values mean "not given".
            prompt_len: The prompt's token count (bounds max_tokens by the context).
            default_max_tokens: max_tokens when not given; None: the rest of the context.

        Raises:
            RequestError: A field of the wrong type or out of range (named), or
                prompt + max_tokens beyond max_model_len.
        """
        try:
            return self._sampling_params(fields, prompt_len, default_max_tokens)
        except RequestError:
            self.metrics.reject("invalid")
            raise

    def _sampling_params(self, fields: Mapping[str, Any], prompt_len: int,
                         default_max_tokens: int | None) -> SamplingParams:
        given: dict[str, Any] = {}
        for name, value in fields.items():
            if value is None:
                continue
            if name not in _FIELD_TYPES:
                raise InvalidRequestError(name, f"unknown sampling parameter {name!r}")
            wanted = _FIELD_TYPES[name]
            if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
                raise InvalidRequestError(name, f"{name} must be "
                                                f"{' or '.join(t.__name__ for t in wanted)}, "
                                                f"not {type(value).__name__}")
            given[name] = value
        room = self.max_model_len - prompt_len
        given.setdefault("max_tokens", room if default_max_tokens is None
                         else min(default_max_tokens, room))
        if "logit_bias" in given:  # JSON object keys are strings
            try:
                given["logit_bias"] = {int(token): bias
                                       for token, bias in given["logit_bias"].items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias", "logit_bias must map token ids to "
                                                        "numbers") from None
        params = SamplingParams(**given, output_kind=RequestOutputKind.DELTA)
        if params.max_tokens > room:
            raise InvalidRequestError(
                "max_tokens", f"max_tokens = {params.max_tokens}: the prompt has {prompt_len} "
                              f"tokens and this model's context is {self.max_model_len}, so "
                              f"at most {room} can be generated")
        # The engine's checks of the parameters against this model (stop_token_ids,
        # logit_bias, ...); the prompt's own ran in encode_prompt.
        self._inputs.validate_params(_CHECK_ID, params)
        return params

    # ------------------------------------------------------------------ generation

    def new_request_id(self, prefix: str) -> str:
        """A server-unique request id like `cmpl-12` (never one `client_request_id` makes)."""
        return f"{prefix}-{next(self._ids)}"

    @staticmethod
    def client_request_id(given: str) -> str:
        """The engine's id for a request id chosen by a client.

        Client ids live in their own namespace (`client:` + the id), so a client that sends
        `grpc-3` cannot collide with the server's `grpc-3`; the front end shows the client
        its id unchanged.
        """
        return CLIENT_ID_PREFIX + given

    async def write(self, write: Awaitable[Any]) -> Any:
        """Awaits one streamed write (a front end's send), within `write_timeout_seconds`.

        Raises:
            SlowClientError: The write did not complete in time (it is cancelled).
        """
        timeout = self.config.write_timeout_seconds
        if timeout is None:
            return await write
        try:
            # A timeout scope rather than wait_for: no task per write (one per streamed chunk).
            async with asyncio.timeout(timeout):
                return await write
        except TimeoutError:
            raise SlowClientError(f"the client took no data for {timeout:g} s (it stopped "
                                  "reading); the call is dropped") from None

    def _expire(self, request_id: str) -> None:
        """Aborts a request that reached `max_request_seconds`."""
        logger.warning("request %s ran for max_request_seconds = %g: aborted", request_id,
                       self.config.max_request_seconds)
        abort = asyncio.ensure_future(self.engine.abort(request_id))
        self._expiring.add(abort)  # the loop holds tasks weakly
        abort.add_done_callback(self._expiring.discard)

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Serves one checked request; yields its outputs, records its metrics.

        The outputs are what `params.output_kind` asks for (DELTA from `sampling_params`).
        Leaving the iteration early (cancellation, disconnect) aborts it and frees its pages;
        so does running past `max_request_seconds` (the last output's finish_reason is then
        "abort").

        Raises:
            OverloadedError: `max_queued_requests` requests are already waiting.
            RequestError: The engine refused the request (nothing was queued).
            RequestFailedError: The engine failed on this request alone.
            EngineDeadError: The engine is not running.
        """
        # Counted in sequences: a request with n samples waits as n scheduler requests.
        waiting = max(self.engine.stats().num_waiting, self._not_admitted)
        if waiting + params.n > self.config.max_queued_requests:
            self.metrics.reject("overloaded")
            raise OverloadedError(f"the server is overloaded: {waiting} sequences are waiting "
                                  f"and this request adds {params.n} (limit "
                                  f"{self.config.max_queued_requests}); retry later")
        timer = self.metrics.start_request(params)
        self._not_admitted += params.n
        admitted = rejected = False
        reasons: dict[int, str | None] = {}  # sample index -> its finish reason
        last: RequestOutput | None = None
        failed = False
        deadline = None if self.config.max_request_seconds is None else (
            asyncio.get_running_loop().call_later(self.config.max_request_seconds,
                                                  self._expire, request_id))
        try:
            try:
                # aclosing: a consumer that stops early must abort the engine request now,
                # not whenever the garbage collector finalizes the inner generator.
                async with contextlib.aclosing(
                        self.engine.generate(prompt, params, request_id)) as stream:
                    async for output in stream:
                        if not admitted:
                            admitted = True
                            self._not_admitted -= params.n
                        last = output
                        if output.error is not None:
                            failed = True
                            raise RequestFailedError(output.error)
                        reasons.update((sample.index, sample.finish_reason)
                                       for sample in output.outputs)
                        timer.output(output)
                        yield output
            except RequestError:
                rejected = True
                self.metrics.reject("invalid")
                raise
        finally:
            if deadline is not None:
                deadline.cancel()
            if not admitted:
                self._not_admitted -= params.n
            if last is None and not rejected:
                timer.finish("abort", 0)  # cancelled before its first output
            if last is not None:
                given = set(reasons.values())
                reason = "error" if failed else "abort" if (
                    not last.finished or "abort" in given) else (
                    sorted(reason for reason in given if reason)[0] if any(given)
                    else "abort")
                timer.finish(reason, len(last.prompt_token_ids))
