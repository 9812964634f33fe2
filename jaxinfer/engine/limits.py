"""The bounds one request may ask for, in one place: each a server option with a sane default.

A server in front of a model takes whatever its clients send, so everything a request can make
the engine do per step or per request is bounded here, and a request past a bound is refused
before anything of it is queued, with a `RequestError` naming the field (HTTP 400, gRPC
INVALID_ARGUMENT). The anchors are OpenAI's own API limits and vLLM's checks:

| limit | default | why |
|---|---|---|
| `max_n` | 128 (and `max_num_seqs`) | vLLM's bound; each sample is a running sequence |
| `max_stop_strings`, `max_stop_string_chars` | 16, 256 | stop strings are searched every step |
| `max_stop_token_ids` | 256 | they become a `[V]` mask row per request |
| `max_logit_bias_entries`, `max_logit_bias` | 300, 100 | OpenAI's limits |
| `max_temperature` | 100 | beyond it the distribution is uniform to float32 precision |
| `max_repetition_penalty` | 100 (and at least its inverse) | a penalty of 1e-40 is 0 in float32 |
| `max_prompts_per_request` | 64 | one completions request fans out into this many |
| `max_prompt_chars` | `max_model_len` x the longest token | checked before tokenizing |

Fixed rules that are not options, because the device's dtypes set them: `top_k` larger than the
vocabulary keeps every token (it is clamped, as vLLM does); a seed is any 64-bit value, signed or
unsigned (`[-2^63, 2^64)`, what torch and vLLM take); presence and frequency penalties are in
[-2, 2] and `logprobs` at most 20 (`SamplingParams`'s own checks).

`docs/serving-limits.md` lists every limit with its flag and the error a client gets.

No jax here: the host scheduler's side imports this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.engine.errors import RequestError


def _help(text: str) -> dict[str, Any]:
    """Field metadata: the flag's help text (`add_engine_arguments` makes the flag)."""
    return {"help": text}


# A seed is any value torch's `manual_seed` takes: a signed or an unsigned 64-bit integer.
MIN_SEED = -(2 ** 63)
MAX_SEED = 2 ** 64 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """What one request may ask for (see the module docstring for the defaults' reasons).

    Attributes:
        max_n: Most samples per prompt (`n`; JetStream's `num_samples`); the engine's
            `max_num_seqs` bounds it too.
        max_stop_strings: Most stop strings per request.
        max_stop_string_chars: Longest stop string, in characters.
        max_stop_token_ids: Most stop token ids per request.
        max_logit_bias_entries: Most `logit_bias` entries per request.
        max_logit_bias: Largest absolute bias.
        max_temperature: Largest temperature.
        max_repetition_penalty: Largest repetition penalty; its inverse is the smallest.
        max_prompts_per_request: Most prompts in one completions request.
        max_prompt_chars: Longest prompt text, checked before it is tokenized; None derives it
            from the model: `max_model_len` times the longest token's characters, the length
            past which no text can fit the context.
    """

    max_n: int = dataclasses.field(
        default=128, metadata=_help("most samples per prompt (n)"))
    max_stop_strings: int = dataclasses.field(
        default=16, metadata=_help("most stop strings per request"))
    max_stop_string_chars: int = dataclasses.field(
        default=256, metadata=_help("longest stop string, in characters"))
    max_stop_token_ids: int = dataclasses.field(
        default=256, metadata=_help("most stop token ids per request"))
    max_logit_bias_entries: int = dataclasses.field(
        default=300, metadata=_help("most logit_bias entries per request"))
    max_logit_bias: float = dataclasses.field(
        default=100.0, metadata=_help("largest absolute logit bias"))
    max_temperature: float = dataclasses.field(
        default=100.0, metadata=_help("largest temperature"))
    max_repetition_penalty: float = dataclasses.field(
        default=100.0, metadata=_help("largest repetition penalty (its inverse is the "
                                            "smallest)"))
    max_prompts_per_request: int = dataclasses.field(
        default=64, metadata=_help("most prompts in one completions request"))
    max_prompt_chars: int | None = dataclasses.field(
        default=None, metadata=_help("longest prompt text, checked before tokenizing "
                                           "(default: max_model_len x the longest token)"))

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "max_prompt_chars":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{field.name} = {value!r}: must be a positive number")
        if self.max_repetition_penalty < 1:
            raise ValueError(f"max_repetition_penalty = {self.max_repetition_penalty!r}: must "
                             "be >= 1 (1 disables the penalty)")

    # ------------------------------------------------------------------ checks

    def check_count(self, field: str, count: int, limit: int, what: str) -> None:
        """Refuses more than `limit` items of a list field.

        Raises:
            RequestError: On `field`, with the limit and the flag that raises it.
        """
        if count > limit:
            raise RequestError(field, f"{field}: {count} {what}, at most {limit} are allowed "
                                      f"(server option {_flag(what)})")

    def check_prompts(self, count: int, field: str = "prompt") -> None:
        """The number of prompts in one request.

        Raises:
            RequestError: On `field`.
        """
        if count > self.max_prompts_per_request:
            raise RequestError(field, f"{field}: {count} prompts in one request, at most "
                                      f"{self.max_prompts_per_request} are allowed (server "
                                      "option --max-prompts-per-request)")

    def prompt_chars(self, max_model_len: int, longest_token_chars: int) -> int:
        """The longest prompt text to tokenize (`max_prompt_chars`, or its derived default)."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max_model_len * max(longest_token_chars, 1)

    def check_params(self, params: Any, max_num_seqs: int) -> None:
        """The checks of one request's `SamplingParams` against these limits.

        Args:
            params: The request's `SamplingParams` (already checked on its own).
            max_num_seqs: The engine's running-sequence limit, which bounds `n` too.

        Raises:
            RequestError: The field at fault is named.
        """
        max_n = min(self.max_n, max_num_seqs)
        if params.n > max_n:
            reason = ("--max-n" if max_n == self.max_n
                      else f"the engine runs at most max_num_seqs = {max_num_seqs} sequences")
            raise RequestError("n", f"n = {params.n}: at most {max_n} samples per prompt "
                                    f"({reason})")
        if params.seed is not None and not MIN_SEED <= params.seed <= MAX_SEED - (params.n - 1):
            raise RequestError("seed", f"seed = {params.seed}: must be a 64-bit integer, in "
                                       f"[-2^63, 2^64 - n]")
        if params.temperature > self.max_temperature:
            raise RequestError("temperature", f"temperature = {params.temperature!r}: must be "
                                              f"<= {self.max_temperature} (--max-temperature)")
        low, high = 1.0 / self.max_repetition_penalty, self.max_repetition_penalty
        if not low <= params.repetition_penalty <= high:
            raise RequestError("repetition_penalty", f"repetition_penalty = "
                               f"{params.repetition_penalty!r}: must be in [{low:g}, {high:g}] "
                               "(--max-repetition-penalty)")
        stop = params.stop_strings
        self.check_count("stop", len(stop), self.max_stop_strings, "stop strings")
        for index, string in enumerate(stop):
            if len(string) > self.max_stop_string_chars:
                raise RequestError("stop", f"stop[{index}]: {len(string)} characters, at most "
                                           f"{self.max_stop_string_chars} are allowed "
                                           "(--max-stop-string-chars)")
        self.check_count("stop_token_ids", len(params.stop_token_ids or ()),
                         self.max_stop_token_ids, "stop token ids")
        bias = params.logit_bias or {}
        self.check_count("logit_bias", len(bias), self.max_logit_bias_entries,
                         "logit bias entries")
        for token_id, value in bias.items():
            if abs(value) > self.max_logit_bias:
                raise RequestError("logit_bias", f"logit_bias[{token_id}] = {value!r}: must be "
                                                 f"in [-{self.max_logit_bias:g}, "
                                                 f"{self.max_logit_bias:g}] (--max-logit-bias)")


def _flag(what: str) -> str:
    """The option that raises the limit on `what` (e.g. "stop strings" -> --max-stop-strings)."""
    return {"stop strings": "--max-stop-strings", "stop token ids": "--max-stop-token-ids",
            "logit bias entries": "--max-logit-bias-entries"}.get(what, "")
