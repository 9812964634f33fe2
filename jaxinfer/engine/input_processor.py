"""The one place a request is checked and turned into scheduler requests (vLLM's Processor).

    processor = InputProcessor(model_config, config, tokenizer, speculative=True)
    processed = processor.process("a", "The list type", SamplingParams(n=2))
    # processed.samples: the scheduler requests "a#0", "a#1"

It takes a prompt in any accepted form (text, token ids, or a dict with "prompt_token_ids"
and/or "prompt"), tokenizes it, runs every check a request needs before it may be queued
(token ids inside the vocabulary for the prompt, `stop_token_ids` and `logit_bias`; room for
output within `max_model_len`; a structured-output schema, regex or grammar that does not
compile (`jaxinfer.engine.structured_output`); features the engine was built without; the
bounds of
`jaxinfer.engine.limits.RequestLimits`, the text's length among them, checked before
tokenizing), and fans a request with
`n > 1` out into n scheduler requests with their own seeds. Every failure is a
`jaxinfer.engine.errors.RequestError` naming the field, raised before anything is queued, so
front ends map errors to their wire format without parsing messages and the requests already
running never notice.

It holds no engine state (only facts about the model and the engine's options), so it can run
on any thread, before a request reaches the engine's own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.host.request import Request
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.structured_output import CompiledGrammar, GrammarCompiler
from jaxinfer.tokenizer import Tokenizer

# What a request's prompt may be: text, token ids, or {"prompt_token_ids": [...], "prompt": ...}.
Prompt = str | Sequence[int] | Mapping[str, Any]


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The scheduler id of sample `index` of a request with `n` samples ("ID" or "ID#i")."""
    return request_id if n == 1 else f"{request_id}#{index}"


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's drafts can be verified exactly in one step: nothing it asks for
    changes from one position to the next or needs per-token results.

    Structured output is one such thing (the allowed tokens change with every token), so a
    constrained request is never speculated on: drafts are not verified against its grammar.
    """
    return (params.logprobs is None and params.prompt_logprobs is None
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0 and params.structured_outputs is None)


@dataclasses.dataclass
class ProcessedRequest:
    """A checked request, ready to queue.

    Attributes:
        request_id: The user's id.
        prompt: The prompt text, when it was given as text (or alongside its ids).
        prompt_token_ids: The prompt's token ids.
        params: The request's sampling parameters (n as asked).
        samples: One scheduler request per sample, ids from `child_request_id`.
        speculate: Whether the engine will propose drafts for it.
        grammar: Its compiled structured-output constraint, or None (each sample holds its
            own matcher of it).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Request]
    speculate: bool
    grammar: CompiledGrammar | None = None


class InputProcessor:
    """Checks requests against one model and engine configuration.

    Args:
        model_config: The served model (vocabulary, EOS ids).
        config: The engine's options, resolved (`EngineConfig.resolved`).
        tokenizer: For text prompts and stop strings; None accepts token ids only.
        speculative: Whether the engine proposes drafts at all.
    """

    def __init__(self, model_config: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | None, *, speculative: bool = False) -> None:
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer
        self.speculative = speculative
        # One per engine: it builds the tokenizer's llguidance view on the first constrained
        # request (about a second for a 150k vocabulary), never for unconstrained ones.
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size,
                                        tuple(model_config.eos_token_ids))

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def process(self, request_id: str, prompt: Prompt,
                sampling_params: SamplingParams | None = None, *,
                cache_salt: str | None = None, speculative: bool = True) -> ProcessedRequest:
        """Checks one request and builds its scheduler requests.

        Args:
            request_id: The user's id (uniqueness is the engine's to check).
            prompt: Text (BOS is added as the tokenizer does), token ids, or a dict with
                "prompt_token_ids" and optionally the "prompt" text they came from (e.g. a
                rendered chat), or with "prompt" only.
            sampling_params: None is `SamplingParams()`.
            cache_salt: Keeps this request's prefix-cache blocks apart from other salts.
            speculative: False opts the request out of speculative decoding.

        Raises:
            RequestError: The field at fault is named; see the module docstring.
        """
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id", f"request id {request_id!r}: must be a "
                                             "non-empty string")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params", f"request {request_id!r}: sampling_params "
                               f"must be a SamplingParams, not {type(params).__name__}")
        text, token_ids = self.tokenize(request_id, prompt)
        self.validate(request_id, token_ids, params)
        params = self.clamped(params)
        grammar = None if params.structured_outputs is None else self.grammars.compile(
            request_id, params.structured_outputs)
        speculate = speculative and self.speculative and can_speculate(params)
        return ProcessedRequest(request_id, text, token_ids, params,
                                self.fan_out(request_id, token_ids, params, cache_salt,
                                             speculate, grammar), speculate, grammar)

    # ------------------------------------------------------------------ pieces

    def tokenize(self, request_id: str, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of any accepted prompt form.

        Raises:
            RequestError: On "prompt": a malformed prompt, or text without a tokenizer.
        """
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or ("prompt" not in prompt and "prompt_token_ids" not in prompt):
                raise RequestError("prompt", f"request {request_id!r}: a prompt dict takes "
                                   "'prompt' (text) and/or 'prompt_token_ids', got keys "
                                   f"{sorted(prompt)}")
            if "prompt_token_ids" not in prompt:
                return self.tokenize(request_id, prompt["prompt"])
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise RequestError("prompt", f"request {request_id!r}: 'prompt' must be text")
            return text, self.tokenize(request_id, prompt["prompt_token_ids"])[1]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", f"request {request_id!r}: a text prompt needs a "
                                   "tokenizer; this engine has none, pass token ids")
            self.check_prompt_chars(request_id, prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and len(prompt) >= self.config.max_model_len:
            # Refused before a list of millions of ids is converted item by item.
            raise RequestError("prompt", f"request {request_id!r}: prompt of {len(prompt)} "
                               f"tokens leaves no room for output within max_model_len = "
                               f"{self.config.max_model_len}")
        try:
            if isinstance(prompt, bytes) or any(isinstance(token, bool | float)
                                                for token in prompt):
                raise TypeError
            token_ids = [int(token) for token in prompt]
        except (TypeError, ValueError):
            raise RequestError("prompt", f"request {request_id!r}: the prompt must be a "
                               "string or a list of token ids") from None
        return None, token_ids

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """The longest prompt text worth tokenizing (`RequestLimits.prompt_chars`).

        Every token covers at most as many characters as the tokenizer's longest token, so a
        longer text cannot fit `max_model_len` tokens (a tokenizer that drops characters while
        normalizing, e.g. runs of spaces, could fit more: raise `max_prompt_chars` for it).
        """
        longest = 1
        if self.tokenizer is not None and self.config.limits.max_prompt_chars is None:
            for token_id in range(self.tokenizer.vocab_size):
                longest = max(longest, len(self.tokenizer.id_to_token(token_id) or ""))
        return self.config.limits.prompt_chars(self.config.max_model_len, longest)

    def check_prompt_chars(self, request_id: str, text: str, field: str = "prompt") -> None:
        """Refuses text too long to fit the context, before tokenizing it.

        Raises:
            RequestError: On `field`.
        """
        if len(text) > self.max_prompt_chars:
            raise RequestError(field, f"request {request_id!r}: {field} of {len(text)} "
                               f"characters cannot fit max_model_len = "
                               f"{self.config.max_model_len} tokens (at most "
                               f"{self.max_prompt_chars} characters; server option "
                               "--max-prompt-chars)")

    def clamped(self, params: SamplingParams) -> SamplingParams:
        """`params` with `top_k` past the vocabulary clamped to "keep every token" (vLLM)."""
        if params.top_k >= self.vocab_size:
            return dataclasses.replace(params, top_k=0)
        return params

    def check_token_ids(self, request_id: str, field: str, what: str,
                        token_ids: Iterable[int]) -> None:
        """The vocabulary check, written once: every id in [0, vocab_size).

        Raises:
            RequestError: On `field`, listing up to five ids outside the vocabulary.
        """
        vocab = self.vocab_size
        bad = [token for token in token_ids if not 0 <= token < vocab]
        if bad:
            raise RequestError(field, f"request {request_id!r}: {what} {bad[:5]} are outside "
                                      f"the vocabulary [0, {vocab})")

    def validate(self, request_id: str, token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        """Every check of a tokenized request against this model and engine.

        Raises:
            RequestError: The field at fault is named.
        """
        self.validate_prompt(request_id, token_ids)
        self.validate_params(request_id, params)

    def validate_prompt(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The prompt's checks: not empty, inside the vocabulary, room left for output.

        Raises:
            RequestError: On "prompt".
        """
        if not token_ids:
            raise RequestError("prompt", f"request {request_id!r}: the prompt must hold at "
                                         "least one token")
        self.check_token_ids(request_id, "prompt", "prompt token ids", token_ids)
        max_model_len = self.config.max_model_len
        if len(token_ids) >= max_model_len:
            raise RequestError("prompt", f"request {request_id!r}: prompt of {len(token_ids)} "
                               f"tokens leaves no room for output within max_model_len = "
                               f"{max_model_len}")

    def validate_params(self, request_id: str, params: SamplingParams) -> None:
        """The sampling parameters' checks against this model and engine (their own value
        checks ran when they were built).

        Raises:
            RequestError: The field at fault is named.
        """
        self.config.limits.check_params(params, self.config.scheduler.max_num_seqs)
        self.check_token_ids(request_id, "stop_token_ids", "stop_token_ids",
                             params.stop_token_ids or ())
        self.check_token_ids(request_id, "logit_bias", "logit_bias token ids",
                             (params.logit_bias or {}).keys())
        if params.prompt_logprobs is not None and not self.config.compile.enable_prompt_logprobs:
            raise RequestError("prompt_logprobs", f"request {request_id!r}: prompt_logprobs "
                               "needs an engine built with enable_prompt_logprobs=True")
        if params.stop_strings and self.tokenizer is None:
            raise RequestError("stop", f"request {request_id!r}: stop strings need a "
                               "tokenizer; this engine has none (use stop_token_ids)")
        if params.structured_outputs is not None:
            # Compiled (and cached) here, so a front end that checks parameters before
            # queuing refuses a bad schema; `process` then finds it compiled.
            self.grammars.compile(request_id, params.structured_outputs)

    def fan_out(self, request_id: str, token_ids: list[int], params: SamplingParams,
                cache_salt: str | None, speculate: bool,
                grammar: CompiledGrammar | None = None) -> list[Request]:
        """One scheduler request per sample, each with its own matcher of `grammar`.

        vLLM's rule: sample i of a seeded request uses seed + i, so the samples differ from
        each other yet each is reproducible.
        """
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        stop_ids = tuple(dict.fromkeys((*eos, *(params.stop_token_ids or ()))))
        samples = []
        for index in range(params.n):
            sample_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index)
            samples.append(Request(
                child_request_id(request_id, index, params.n), token_ids, sample_params,
                max_tokens=params.max_tokens, eos_token_ids=stop_ids, cache_salt=cache_salt,
                skip_prefix_cache=params.prompt_logprobs is not None, speculate=speculate,
                grammar=None if grammar is None else grammar.matcher()))
        return samples
