"""Per-request sampling parameters, host side: vLLM's `SamplingParams` names, defaults and checks.

Pure Python (no jax), like the scheduler, so building and validating a request costs nothing on
the device and the front ends can reject bad input before a request is queued. The
device-side counterpart is `jaxinfer.engine.device.sampler.SamplingArrays`, which
`build_sampling_arrays` fills from a batch of these.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from jaxinfer.engine.errors import RequestError

# vLLM's `_SAMPLING_EPS`: a temperature below this is greedy. Dividing logits by a temperature
# this small would only turn float noise into the decision, so the argmax is the honest answer.
GREEDY_TEMPERATURE_EPS = 1e-5

# vLLM's default `max_logprobs`: the most top-logprob entries a request may ask for per token.
MAX_LOGPROBS = 20


def _fail(name: str, value: Any, rule: str) -> NoReturn:
    """Raises the one message format every check uses: `name = value: rule`, naming the field
    (`stop[2]` and `logit_bias token id` belong to `stop` and `logit_bias`)."""
    field = name.split("[")[0].split(" ")[0]
    raise RequestError(field, f"{name} = {value!r}: {rule}")


def _real(name: str, value: Any) -> float:
    """Returns `value` as a float, rejecting bools, non-numbers and NaN."""
    # bool is an int subclass; `temperature=True` is a caller bug, not a temperature of 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        _fail(name, value, "must be a number")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, value, "must be an integer")
    return int(value)


def _check_range(name: str, value: Any, low: float, high: float, interval: str) -> None:
    """Checks a finite number against a closed range (`interval` is the message's spelling)."""
    number = _real(name, value)
    if not low <= number <= high:
        _fail(name, value, f"must be in {interval}")


# The constraint kinds of `StructuredOutputsParams`, exactly one of which a request sets.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `StructuredOutputsParams`, the same names).

    Exactly one of `json`, `json_object`, `regex`, `choice` and `grammar` is set. The checks
    here are of shape only (types, exactly one kind); whether a schema, regex or grammar
    compiles is the engine's to check (`jaxinfer.engine.structured_output`), since that needs
    the grammar engine and the tokenizer. A failure of either is a `RequestError` on
    "structured_outputs".

    Attributes:
        json: A JSON schema, as a dict or as JSON text; the output is JSON that validates.
        json_object: True: the output is any JSON object (OpenAI's `json_object` mode).
        regex: A regular expression (Rust `regex` syntax) the whole output matches.
        choice: The output is exactly one of these strings (a non-empty list).
        grammar: A context-free grammar in Lark syntax (llguidance's dialect; GBNF as
            llama.cpp writes it is accepted too).
        disable_any_whitespace: JSON without optional whitespace (compact output): small
            models otherwise may pad JSON with whitespace until max_tokens.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        field = "structured_outputs"
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    json.loads(self.json)
                except ValueError as error:
                    raise RequestError(field, f"structured_outputs.json is not valid JSON: "
                                              f"{error}") from None
            elif not isinstance(self.json, dict):
                raise RequestError(field, "structured_outputs.json must be a JSON schema "
                                          f"(an object or its JSON text), not "
                                          f"{type(self.json).__name__}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise RequestError(field, "structured_outputs.json_object must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(field, f"structured_outputs.{name} must be a non-empty "
                                          "string")
        if self.choice is not None:
            if isinstance(self.choice, str | bytes) or not isinstance(self.choice, Iterable):
                raise RequestError(field, "structured_outputs.choice must be a list of strings")
            choice = tuple(self.choice)
            if not choice or not all(isinstance(item, str) and item for item in choice):
                raise RequestError(field, "structured_outputs.choice must be a non-empty list "
                                          "of non-empty strings")
            object.__setattr__(self, "choice", choice)
        if not isinstance(self.disable_any_whitespace, bool):
            raise RequestError(field, "structured_outputs.disable_any_whitespace must be a "
                                      "bool")
        kinds = self.kinds
        if len(kinds) != 1:
            raise RequestError(field, f"structured_outputs must set exactly one of "
                                      f"{list(STRUCTURED_OUTPUT_KINDS)}, got "
                                      f"{kinds or 'none'}")

    @property
    def kinds(self) -> list[str]:
        """The constraint kinds set (one, once constructed)."""
        return [name for name in STRUCTURED_OUTPUT_KINDS
                if getattr(self, name) not in (None, False)]

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """Accepts the dataclass itself or a mapping of its fields (e.g. a JSON body's).

        Raises:
            RequestError: On "structured_outputs": an unknown key, a value of the wrong
                type, or not exactly one kind set.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise RequestError("structured_outputs", "structured_outputs must be an object "
                                                     f"with one of "
                                                     f"{list(STRUCTURED_OUTPUT_KINDS)}")
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in value if key not in names)
        if unknown:
            raise RequestError("structured_outputs", f"structured_outputs: unknown keys "
                                                     f"{unknown}; known: {sorted(names)}")
        # None means "not given", as everywhere on the wire.
        return cls(**{key: item for key, item in value.items() if item is not None})


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request holds (vLLM's `output_kind`).

    CUMULATIVE: everything so far (text, tokens, logprobs), every step; DELTA: only what is new
    since the request's previous output (servers stream these; nothing is copied per step);
    FINAL_ONLY: one cumulative output, when the request finishes.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and defaults).

    Attributes:
        n: Number of completions to return for the prompt; >= 1.
        temperature: Softmax temperature; >= 0. Below `GREEDY_TEMPERATURE_EPS` (0 in practice)
            the request is greedy.
        top_p: Nucleus mass in (0, 1]; 1 keeps every token.
        top_k: Keep the k most likely tokens; 0 or -1 keeps every token (-1 is stored as 0).
        min_p: Keep tokens whose probability is >= min_p times the most likely token's, in
            [0, 1]; 0 disables.
        seed: Per-request seed for reproducible draws; None lets the engine choose.
        presence_penalty: Subtracted once from every token already generated, in [-2, 2].
        frequency_penalty: Subtracted per occurrence of a token already generated, in [-2, 2].
        repetition_penalty: HF-style multiplicative penalty on tokens seen in the prompt or the
            output; > 0, and 1 disables.
        logit_bias: `{token_id: bias}` added to the logits before anything else; ids >= 0 (the
            upper bound is the vocabulary, checked by `dense_logit_bias`), finite biases.
        max_tokens: Most tokens to generate; >= 1.
        min_tokens: Stop tokens (EOS unless `ignore_eos`, and `stop_token_ids`) are masked
            until this many tokens exist; in [0, max_tokens].
        stop: Stop string or strings; the output ends before (or, with
            `include_stop_str_in_output`, after) the first match. A list is stored as a tuple.
        stop_token_ids: Token ids that end the request like EOS does; stored as a tuple.
        include_stop_str_in_output: Keep the matched stop string in the text.
        ignore_eos: Keep generating past EOS (stop_token_ids still stop).
        logprobs: Number of top logprobs to return per generated token, in [0, 20]; None
            returns none (0 returns only the chosen token's).
        prompt_logprobs: Same, for each prompt token; None returns none.
        skip_special_tokens: Leave special tokens out of the detokenized text.
        output_kind: Cumulative outputs (the default), deltas, or the final output only; a
            `RequestOutputKind` or its value.
        structured_outputs: A constraint the output must match (JSON schema, JSON object,
            regex, choice or grammar): a `StructuredOutputsParams` or a mapping of its fields.
            Such a request never speculates (drafts are not checked against the grammar).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if _integer("n", self.n) < 1:
            _fail("n", self.n, "must be >= 1")
        temperature = _real("temperature", self.temperature)
        if not 0 <= temperature < math.inf:
            _fail("temperature", self.temperature, "must be >= 0 (and finite)")
        if not 0 < _real("top_p", self.top_p) <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if _integer("top_k", self.top_k) < -1:
            _fail("top_k", self.top_k, "must be 0 or -1 (keep every token), or >= 1")
        _check_range("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        if self.seed is not None:
            _integer("seed", self.seed)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        repetition = _real("repetition_penalty", self.repetition_penalty)
        if not 0 < repetition < math.inf:
            _fail("repetition_penalty", self.repetition_penalty, "must be > 0 (and finite)")
        if _integer("max_tokens", self.max_tokens) < 1:
            _fail("max_tokens", self.max_tokens, "must be >= 1")
        if not 0 <= _integer("min_tokens", self.min_tokens) <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be in [0, max_tokens = {self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= _integer(name, value) <= MAX_LOGPROBS:
                _fail(name, value, f"must be None or in [0, {MAX_LOGPROBS}]")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be a bool")
        # Normalized copies, so a caller mutating its list or dict later cannot change a request
        # that is already queued (the dataclass is frozen; object.__setattr__ is the sanctioned
        # way to normalize in __post_init__).
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        try:
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        except ValueError:
            _fail("output_kind", self.output_kind,
                  f"must be one of {[kind.value for kind in RequestOutputKind]}")
        object.__setattr__(self, "stop", self._checked_stop())
        object.__setattr__(self, "stop_token_ids", self._checked_stop_token_ids())
        object.__setattr__(self, "logit_bias", self._checked_logit_bias())
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams.from_value(self.structured_outputs))

    def _checked_stop(self) -> str | tuple[str, ...] | None:
        if self.stop is None or isinstance(self.stop, str):
            if self.stop == "":
                _fail("stop", self.stop, "stop strings must be non-empty")
            return self.stop
        if not isinstance(self.stop, Iterable):
            _fail("stop", self.stop, "must be a string, a list of strings, or None")
        stop = tuple(self.stop)
        for index, string in enumerate(stop):
            if not isinstance(string, str) or not string:
                _fail(f"stop[{index}]", string, "stop strings must be non-empty strings")
        return stop

    def _checked_stop_token_ids(self) -> tuple[int, ...] | None:
        if self.stop_token_ids is None:
            return None
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(
                self.stop_token_ids, Iterable):
            _fail("stop_token_ids", self.stop_token_ids, "must be a list of token ids or None")
        ids = tuple(self.stop_token_ids)
        for index, token_id in enumerate(ids):
            if _integer(f"stop_token_ids[{index}]", token_id) < 0:
                _fail(f"stop_token_ids[{index}]", token_id, "token ids must be >= 0")
        return tuple(int(token_id) for token_id in ids)

    def _checked_logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", self.logit_bias, "must be a dict {token_id: bias} or None")
        checked: dict[int, float] = {}
        for token_id, bias in self.logit_bias.items():
            if _integer("logit_bias token id", token_id) < 0:
                _fail("logit_bias token id", token_id, "token ids must be >= 0")
            value = _real(f"logit_bias[{token_id}]", bias)
            # +inf would make the softmax NaN; -100 already bans a token in practice.
            if not math.isfinite(value):
                _fail(f"logit_bias[{token_id}]", bias, "must be a finite number")
            checked[int(token_id)] = value
        return checked

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax: temperature ~0 or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple (empty when there are none)."""
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(self.stop)

    def min_tokens_stop_ids(self, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
        """Token ids masked while fewer than `min_tokens` tokens exist (vLLM's rule).

        Args:
            eos_token_ids: The model's end-of-sequence ids; left out when `ignore_eos`.

        Returns:
            Sorted unique ids: `stop_token_ids`, plus the EOS ids unless `ignore_eos`.
        """
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids.update(int(token_id) for token_id in eos_token_ids)
        return tuple(sorted(ids))
