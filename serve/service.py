"""What both front ends share: request checks, admission, the API key, metrics, generation.

A front end (gRPC or HTTP) parses its wire format into plain Python values, then calls:

    service.check_api_key(authorization_header)        # UnauthenticatedError
    params = service.sampling_params(fields, prompt_len) # InvalidRequestError(field, message)
    async for output in service.generate(prompt, params, request_id):  # OverloadedError
        ...                                              # cumulative RequestOutputs

and maps the three errors to its status codes (UNAUTHENTICATED / 401, INVALID_ARGUMENT / 400,
RESOURCE_EXHAUSTED / 429). Everything the engine rejects (an empty prompt, unknown token ids, a
prompt that fills the context) comes back as an `InvalidRequestError` that names the field, and
nothing is queued, so the requests already running never notice.

Admission is a bound on requests that have not yet been admitted to the engine's running set:
when `max_queued_requests` are already waiting, a new one is refused at once rather than
queued behind minutes of work (the client can retry elsewhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import itertools
from collections.abc import AsyncIterator, Mapping
from typing import Any

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.core import Prompt
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import SamplingParams
from serve.metrics import ServingMetrics


class InvalidRequestError(ValueError):
    """A request field is wrong; `field` names it (None: the request as a whole)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class OverloadedError(RuntimeError):
    """The waiting queue is full; retry later."""


class UnauthenticatedError(PermissionError):
    """The call lacks the server's API key."""


# SamplingParams fields a request may set, with the Python types each accepts on the wire.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "n": (int,), "temperature": (int, float), "top_p": (int, float), "top_k": (int,),
    "min_p": (int, float), "seed": (int,), "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "repetition_penalty": (int, float),
    "logit_bias": (dict,), "max_tokens": (int,), "min_tokens": (int,), "stop": (str, list),
    "stop_token_ids": (list,), "include_stop_str_in_output": (bool,), "ignore_eos": (bool,),
    "logprobs": (int,), "prompt_logprobs": (int,), "skip_special_tokens": (bool,),
}
SAMPLING_FIELDS = tuple(_FIELD_TYPES)


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """Server-wide request policy.

    Attributes:
        model_name: The name clients address the model by (`/v1/models`, `ModelInfo`).
        max_queued_requests: Requests allowed to wait for admission before new ones get
            RESOURCE_EXHAUSTED / 429.
        api_key: If set, every call must carry `authorization: Bearer <api_key>`.
        chat_template: Jinja source for chat requests; None uses the tokenizer's own.
    """

    model_name: str
    max_queued_requests: int = 256
    api_key: str | None = None
    chat_template: str | None = None


class InferenceService:
    """The engine plus the policy around it; one per server process.

    Args:
        engine: A started (or about to be started) `AsyncEngine`.
        config: Names, limits and the API key.
    """

    def __init__(self, engine: AsyncEngine, config: ServiceConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServingMetrics(engine.stats, config.model_name)
        self._ids = itertools.count()
        self._not_admitted = 0  # requests inside generate() that have produced nothing yet

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
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
            self.metrics.reject("unauthenticated")
            raise UnauthenticatedError("missing or wrong API key: send the header "
                                       "'authorization: Bearer <key>'")

    def encode_prompt(self, prompt: Any, field: str = "prompt") -> list[int]:
        """Text or token ids to a checked, non-empty list of token ids.

        Raises:
            InvalidRequestError: Empty, of the wrong type, ids outside the vocabulary, text
                without a tokenizer, or no room for output within max_model_len.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(field, f"{field} must not be empty")
            if self.tokenizer is None:
                raise InvalidRequestError(field, f"{field}: this model has no tokenizer; "
                                                 "send token ids")
            token_ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, list | tuple) and all(
                isinstance(token, int) and not isinstance(token, bool) for token in prompt):
            token_ids = list(prompt)
        else:
            raise InvalidRequestError(field, f"{field} must be a string or a list of token ids")
        if not token_ids:
            raise InvalidRequestError(field, f"{field} must hold at least one token")
        bad = [token for token in token_ids if not 0 <= token < self.vocab_size]
        if bad:
            raise InvalidRequestError(field, f"{field}: token ids {bad[:5]} are outside the "
                                             f"vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                field, f"{field} has {len(token_ids)} tokens; this model's context is "
                       f"{self.max_model_len} tokens, which leaves no room for output")
        return token_ids

    def sampling_params(self, fields: Mapping[str, Any], prompt_len: int,
                        default_max_tokens: int | None = 16) -> SamplingParams:
        """Checks wire fields and builds SamplingParams.

        Args:
            fields: SamplingParams field names to values; None values mean "not given".
            prompt_len: The prompt's token count (bounds max_tokens by the context).
            default_max_tokens: max_tokens when not given; None: the rest of the context.

        Raises:
            InvalidRequestError: A field of the wrong type or out of range (named), or
                prompt + max_tokens beyond max_model_len.
        """
        given = {}
        for name, value in fields.items():
            if value is None:
                continue
            if name not in _FIELD_TYPES:
                raise InvalidRequestError(name, f"unknown sampling parameter {name!r}")
            types = _FIELD_TYPES[name]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                wanted = " or ".join(t.__name__ for t in types)
                raise InvalidRequestError(name, f"{name} must be {wanted}, "
                                                f"not {type(value).__name__}")
            given[name] = value
        room = self.max_model_len - prompt_len
        given.setdefault("max_tokens", room if default_max_tokens is None
                         else min(default_max_tokens, room))
        if isinstance(given.get("logit_bias"), dict):
            try:
                given["logit_bias"] = {int(token): float(bias)
                                       for token, bias in given["logit_bias"].items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias", "logit_bias must map token ids to "
                                                        "numbers") from None
        try:
            params = SamplingParams(**given)
        except (ValueError, TypeError) as error:
            message = str(error)
            field = message.split(" = ", 1)[0] if " = " in message else None
            raise InvalidRequestError(field if field in _FIELD_TYPES else None,
                                      message) from None
        if params.max_tokens > room:
            raise InvalidRequestError(
                "max_tokens", f"max_tokens = {params.max_tokens}: the prompt has {prompt_len} "
                              f"tokens and this model's context is {self.max_model_len}, so "
                              f"at most {room} can be generated")
        for token in itertools.chain(params.stop_token_ids or (), (params.logit_bias or {})):
            if not 0 <= token < self.vocab_size:
                field = "stop_token_ids" if token in (params.stop_token_ids or ()) \
                    else "logit_bias"
                raise InvalidRequestError(field, f"{field}: token id {token} is outside the "
                                                 f"vocabulary [0, {self.vocab_size})")
        return params

    # ------------------------------------------------------------------ generation

    def new_request_id(self, prefix: str) -> str:
        """A server-unique request id like `cmpl-12`."""
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Serves one checked request; yields cumulative outputs, records its metrics.

        Leaving the iteration early (cancellation, disconnect) aborts it and frees its pages.

        Raises:
            OverloadedError: `max_queued_requests` requests are already waiting.
            InvalidRequestError: The engine refused the request (nothing was queued).
            EngineDeadError: The engine is not running.
        """
        waiting = self.engine.stats().num_waiting
        if max(waiting, self._not_admitted) >= self.config.max_queued_requests:
            self.metrics.reject("overloaded")
            raise OverloadedError(f"the server is overloaded: {waiting} requests are waiting "
                                  f"(limit {self.config.max_queued_requests}); retry later")
        timer = self.metrics.start_request()
        self._not_admitted += 1
        admitted = rejected = False
        last: RequestOutput | None = None
        try:
            try:
                # aclosing: a consumer that stops early must abort the engine request now,
                # not whenever the garbage collector finalizes the inner generator.
                async with contextlib.aclosing(
                        self.engine.generate(prompt, params, request_id)) as stream:
                    async for output in stream:
                        if not admitted:
                            admitted = True
                            self._not_admitted -= 1
                        last = output
                        timer.tokens(sum(len(sample.token_ids) for sample in output.outputs))
                        yield output
            except ValueError as error:
                rejected = True
                self.metrics.reject("invalid")
                raise InvalidRequestError(None, str(error)) from None
        finally:
            if not admitted:
                self._not_admitted -= 1
            if last is None and not rejected:
                timer.finish("abort", 0)  # cancelled before its first output
            if last is not None:
                reasons = {sample.finish_reason for sample in last.outputs}
                reason = "abort" if not last.finished or "abort" in reasons else (
                    sorted(reason for reason in reasons if reason)[0] if any(reasons)
                    else "abort")
                timer.finish(reason, len(last.prompt_token_ids))
