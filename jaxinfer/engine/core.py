"""The synchronous engine loop: schedule on the host, run one device step, process outputs.

    engine = Engine(model, EngineConfig(max_num_seqs=16), tokenizer=tokenizer)
    engine.add_request("a", "The list type", SamplingParams(max_tokens=32, stop=["\\n\\n"]))
    while engine.has_unfinished_requests():
        for output in engine.step():
            ...  # a jaxinfer.engine.outputs.RequestOutput, cumulative so far

`step()` is vLLM v1's loop body: `Scheduler.schedule()` decides which tokens of which requests
to compute within the token budget; `ModelRunner.execute` packs them, runs the jitted step over
the paged cache and samples; `Scheduler.update_from_output` appends the tokens, stops requests
on stop tokens and lengths and releases their pages; then each sample's `SampleState`
detokenizes, looks for stop strings (a match aborts the scheduler request at once, freeing its
pages) and collects logprobs. The scheduler never touches device arrays and the runner never
makes scheduling decisions.

Speculative decoding (`speculative={"method": "ngram", "num_tokens": k, "max_ngram": n}` or
`{"method": "draft_model", "model": ..., "num_tokens": k}`): before each step, the engine's
proposer (`jaxinfer.engine.spec.proposer.Proposer`: `ngram`, `draft_model`, or one passed in)
drafts up to k tokens for every running request that speculates and is decoding; the engine
hands the drafts to `Scheduler.schedule(drafts)`, which budgets them, the runner verifies them with
exact speculative sampling in the same ragged step, and the scheduler keeps the accepted ones
and rolls back the rest. A request speculates unless it opts out (`speculative=False`) or asks
for something that changes per position or needs per-token results: logprobs, prompt
logprobs, repetition/frequency/presence penalties; it drafts nothing while min_tokens still
holds stop tokens back. Speculating and plain requests share every batch. A seeded speculating
request samples exactly from the target's distribution and repeats itself when run the same
way, but its draws depend on which drafts were verified, so (unlike a plain seeded request) its
tokens can change when a crowded batch's token budget trims its drafts.

A request with `n > 1` becomes n scheduler requests ("ID#0", "ID#1", ...). With prefix caching
on, the first one runs alone until its prompt is computed, and the others are admitted after
it, so they find every full prompt block in the prefix cache and share those pages (reference
counted) instead of computing and storing the prompt n times.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxinfer.engine.device.runner import ModelRunner, PromptLogprobs, RunnerConfig, SampledToken
from jaxinfer.engine.host.draft import Draft, SpecStats
from jaxinfer.engine.host.request import Request
from jaxinfer.engine.host.scheduler import Scheduler, SchedulerConfig
from jaxinfer.engine.output_processor import SampleState
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.parallel import ParallelConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.spec.ngram import SpeculativeConfig
from jaxinfer.engine.spec.proposer import Proposer, build_proposer
from jaxinfer.model_loading import resolve_model_path
from jaxinfer.models import Transformer
from jaxinfer.tokenizer import Tokenizer, load_tokenizer

# What a request's prompt may be: text, token ids, or {"prompt_token_ids": [...], "prompt": ...}.
Prompt = str | Sequence[int] | Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine options (vLLM's names where they exist).

    Attributes:
        page_size: Tokens per KV-cache page (vLLM's block_size).
        num_pages: Pages in the pool, the null page included; None sizes it for
            `max_num_seqs` sequences of `max_model_len` tokens.
        max_num_batched_tokens: Token budget of one step (prefill chunks and decodes).
        max_num_seqs: Most requests running at once.
        max_model_len: Longest sequence; None means the model's max_position_embeddings.
        enable_prefix_caching: Share the KV pages of identical full prompt blocks.
        enable_prompt_logprobs: Compile the step variant that can return prompt logprobs
            (doubles warm-up); requests asking for them are rejected without it.
        cache_dtype: KV page dtype; None means the model's compute dtype.
        kv_cache_dtype: "int8" quantizes the KV cache (int8 pages, one float32 scale per
            token and KV head, attention reads them back); None keeps `cache_dtype`.
        min_token_bucket: The smallest padded token count of a step.
        bucket_growth: Ratio of consecutive token and sequence buckets (2 pads least; 4
            compiles fewer programs, so warm-up is faster).
        speculative: Speculative decoding, as a `SpeculativeConfig` or a dict of its fields
            (e.g. `{"method": "ngram", "num_tokens": 4, "max_ngram": 3}`); None turns it off.
        tensor_parallel_size: Devices the model's heads, MLP and vocabulary are split over
            (see `jaxinfer.engine.parallel`).
        data_parallel_size: Independent engine replicas (`load_engine` builds them).
        expert_parallel_size: Devices a MoE model's experts are split over.
    """

    page_size: int = 16
    num_pages: int | None = None
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_prompt_logprobs: bool = True
    cache_dtype: str | None = None
    kv_cache_dtype: str | None = None
    min_token_bucket: int = 8
    bucket_growth: int = 2
    speculative: SpeculativeConfig | Mapping[str, Any] | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        self.parallel  # noqa: B018 -- validates the three sizes now, naming a bad one
        if self.kv_cache_dtype not in (None, "int8"):
            raise ValueError(f"kv_cache_dtype = {self.kv_cache_dtype!r}: None or 'int8'")
        if self.kv_cache_dtype is not None and self.cache_dtype is not None:
            raise ValueError(f"give cache_dtype ({self.cache_dtype!r}) or kv_cache_dtype "
                             f"({self.kv_cache_dtype!r}), not both")

    @property
    def parallel(self) -> ParallelConfig:
        """The tensor, data and expert parallel sizes."""
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              data_parallel_size=self.data_parallel_size,
                              expert_parallel_size=self.expert_parallel_size)

    def resolved(self, model_max_len: int) -> EngineConfig:
        """This config with the None fields filled in for a model."""
        max_model_len = self.max_model_len or model_max_len
        pages_per_sequence = -(-max_model_len // self.page_size)
        num_pages = self.num_pages or self.max_num_seqs * pages_per_sequence + 1
        if num_pages - 1 < pages_per_sequence:
            # Otherwise a long request could wait forever for pages that never exist.
            raise ValueError(f"num_pages = {num_pages}: one sequence of max_model_len = "
                             f"{max_model_len} tokens needs {pages_per_sequence} pages of "
                             f"{self.page_size} plus the null page")
        return dataclasses.replace(self, max_model_len=max_model_len, num_pages=num_pages,
                                   speculative=SpeculativeConfig.parse(self.speculative))


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What `Engine.stats()` reports.

    Attributes:
        num_running: Sequences (samples) scheduled in the running set.
        num_waiting: Sequences waiting for admission (new or preempted).
        kv_cache_usage: Fraction of the page pool held by requests (cached-but-free pages
            count as free: they are evicted on demand).
        prefix_cache_hit_rate: Fraction of admitted prompt tokens served by the prefix cache.
        num_preemptions: Preemptions since the engine was built.
        num_steps: Device steps run since the engine was built.
        num_spec_steps: Request-steps that verified drafts.
        num_draft_tokens: Draft tokens verified.
        num_accepted_tokens: Of those, the accepted ones.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def spec(self) -> SpecStats:
        """The speculative-decoding counters, with their rates."""
        return SpecStats(self.num_spec_steps, self.num_draft_tokens, self.num_accepted_tokens)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.spec.acceptance_rate


class _RequestState:
    """One user request: its prompt, parameters, samples and prompt logprobs."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Tokenizer | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.samples = [SampleState(index, prompt_token_ids, tokenizer, params.stop_strings,
                                    params.include_stop_str_in_output,
                                    params.skip_special_tokens) for index in range(params.n)]
        # vLLM's format: None for the first prompt token, then a dict per prompt token.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            None if params.prompt_logprobs is None else [None])
        self.deferred: list[Request] = []  # samples waiting for the prompt to be cached
        self.speculative: SpecStats | None = None

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Records a chunk's prompt logprobs (positions already known, e.g. recomputed after a
        preemption, are skipped)."""
        known = len(self.prompt_logprobs)
        top = self.params.prompt_logprobs
        for row in range(len(chunk.logprobs)):
            position = chunk.first_position + row
            if position < known:
                continue
            token = self.prompt_token_ids[position]
            self.prompt_logprobs.append(_logprob_dict(
                token, float(chunk.logprobs[row]), chunk.top_token_ids[row][:top],
                chunk.top_logprobs[row][:top]))

    def output(self) -> RequestOutput:
        prompt_logprobs = None
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(
                self.prompt_token_ids):
            prompt_logprobs = list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids),
                             [sample.output() for sample in self.samples], self.finished,
                             prompt_logprobs=prompt_logprobs,
                             speculative=None if self.speculative is None else
                             dataclasses.replace(self.speculative))


def _can_speculate(params: SamplingParams) -> bool:
    """Whether a request's drafts can be verified exactly in one step: nothing it asks for
    changes from one position to the next or needs per-token results."""
    return (params.logprobs is None and params.prompt_logprobs is None
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0)


def _is_decoding(request: Request) -> bool:
    """Whether the request's next step feeds only its last token (no prefill left), and
    min_tokens no longer holds stop tokens back (it would change per draft position)."""
    return (request.num_computed_tokens == request.num_tokens - 1
            and request.num_output_tokens >= request.sampling_params.min_tokens)


def _logprob_dict(token_id: int, logprob: float, top_ids: np.ndarray,
                  top_values: np.ndarray) -> dict[int, float]:
    """{chosen token: logprob, then the top alternatives}, as vLLM reports one position."""
    entry = {int(token_id): logprob}
    for top_id, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
        entry.setdefault(int(top_id), float(value))
    return entry


def engine_config(engine_options: Mapping[str, Any]) -> EngineConfig:
    """An EngineConfig from keyword options, naming the valid ones if any is unknown.

    Raises:
        ValueError: An unknown option or a bad value.
    """
    options = {field.name for field in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_options) - options)
    if unknown:
        raise ValueError(f"unknown engine options {unknown}; valid: {sorted(options)}")
    return EngineConfig(**engine_options)


def load_tokenizer_of(model: str | os.PathLike[str],
                      tokenizer: str | os.PathLike[str] | None) -> Tokenizer | None:
    """The tokenizer in `tokenizer` (must exist) or else in the model's directory (may not:
    `random:PRESET` serves token ids only)."""
    try:
        return load_tokenizer(resolve_model_path(tokenizer if tokenizer is not None else model))
    except FileNotFoundError:
        if tokenizer is not None:
            raise
        return None


class Engine:
    """Continuous batching over one model: add requests at any time, call `step()`."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, *,
                 draft_model: Transformer | None = None, mesh: Mesh | None = None,
                 proposer: Proposer | None = None) -> None:
        """Builds the scheduler, the page pool and the jitted step (not yet compiled).

        Args:
            model: The model to serve, already placed on `mesh` if one is given.
            config: Engine options.
            tokenizer: For text prompts, output text and stop strings; None serves token ids.
            draft_model: The drafter for `speculative={"method": "draft_model", ...}`, if
                already built; None loads the config's `model` name.
            mesh: The replica's device mesh (see `jaxinfer.engine.parallel`); None: one
                device. The page pool is split over it like the model's KV heads.
            proposer: Drafts tokens in place of the one `speculative` names (which still
                sets how many are verified, and whether drafts carry distributions).

        Raises:
            ValueError: An invalid config (the field is named), a drafter whose
                vocabulary differs from the target's, or a proposer without `speculative`.
        """
        config = (config or EngineConfig()).resolved(model.config.max_position_embeddings)
        if config.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size = {config.data_parallel_size}: an Engine is "
                             "one replica; build replicas with "
                             "jaxinfer.engine.load_engine or DataParallelEngine")
        self.config = config
        self.model = model
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, block_size=config.page_size,
            num_blocks=config.num_pages, enable_prefix_caching=config.enable_prefix_caching,
            max_model_len=config.max_model_len))
        self.runner = ModelRunner(model, RunnerConfig(
            num_pages=config.num_pages, page_size=config.page_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            cache_dtype=config.kv_cache_dtype or config.cache_dtype,
            min_token_bucket=config.min_token_bucket,
            enable_prompt_logprobs=config.enable_prompt_logprobs,
            bucket_growth=config.bucket_growth,
            num_speculative_tokens=config.speculative.num_tokens if config.speculative else 0,
            draft_distributions=(config.speculative is not None
                                 and config.speculative.method == "draft_model")),
            mesh=mesh)
        self.speculative: SpeculativeConfig | None = config.speculative
        self.spec_stats = SpecStats()
        if proposer is not None and self.speculative is None:
            raise ValueError("a proposer needs speculative options (num_tokens at least)")
        self.proposer: Proposer | None = proposer if proposer is not None else build_proposer(
            self.speculative, model, self.runner.config, draft_model=draft_model)
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, tuple[_RequestState, int]] = {}  # scheduler id -> sample
        self.num_steps = 0
        self.num_preemptions = 0

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike[str], *,
                        tokenizer: str | os.PathLike[str] | None = None,
                        dtype: str | None = None, **engine_options: Any) -> Engine:
        """Loads a model (and its tokenizer, if it has one) and builds an engine for it.

        Args:
            model: A Hugging Face directory, `builtin:NAME`, a jaxinfer checkpoint directory
                or `random:PRESET`.
            tokenizer: Directory of the tokenizer files; None looks in the model's.
            dtype: "float32" or "bfloat16" for parameters and compute; None keeps the
                checkpoint's.
            **engine_options: `EngineConfig` fields; `tensor_parallel_size` and
                `expert_parallel_size` place the model on a mesh of the first devices
                (`jaxinfer.engine.data_parallel.load_engine` also builds DP replicas).

        Raises:
            ValueError: An unknown engine option (the valid ones are listed), a bad value, or
                a parallel layout the model or the machine cannot take
                (`jaxinfer.engine.parallel.ParallelConfigError`).
            FileNotFoundError: The model (or a given tokenizer) does not exist.
        """
        from jaxinfer.engine.data_parallel import load_engine

        if engine_config(engine_options).data_parallel_size != 1:
            raise ValueError("data_parallel_size > 1 builds several engines: use "
                             "jaxinfer.engine.data_parallel.load_engine")
        return load_engine(model, tokenizer=tokenizer, dtype=dtype, **engine_options)

    def warm_up(self) -> float:
        """Compiles every bucket of the device step (and the proposer's); returns seconds."""
        seconds = self.runner.warm_up()
        if self.proposer is not None:
            seconds += self.proposer.warm_up()
        return seconds

    @property
    def compilations(self) -> int:
        """Programs compiled so far, the proposer's included (constant after `warm_up`)."""
        return self.runner.compilations + (
            self.proposer.compilations if self.proposer is not None else 0)

    @property
    def runners(self) -> list[ModelRunner]:
        """The engine's runner (one replica), as `DataParallelEngine.runners` lists its."""
        return [self.runner]

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: Prompt,
                    sampling_params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, speculative: bool = True) -> None:
        """Queues a request; it joins the running batch at the next step that has room.

        Args:
            request_id: Unique among unfinished requests.
            prompt: Text (needs the tokenizer; BOS is added as the tokenizer does), token
                ids, or a dict with "prompt_token_ids" and optionally the "prompt" text they
                came from (e.g. a rendered chat), or with "prompt" only.
            sampling_params: How to sample and when to stop; None is `SamplingParams()`.
            cache_salt: Keeps this request's prefix-cache blocks apart from other salts.
            speculative: False opts the request out of the engine's speculative decoding
                (it has no effect on an engine without it, or on a request that cannot
                speculate, see the module docstring).

        Raises:
            ValueError: A duplicate id, an empty prompt, a token id outside the vocabulary
                (prompt, logit_bias or stop_token_ids), a prompt that leaves no room for output
                within max_model_len, prompt logprobs while they are disabled, or text without
                a tokenizer. Nothing is queued then.
        """
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: sampling_params must be a "
                             f"SamplingParams, not {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(request_id, prompt)
        self._validate(request_id, token_ids, params)
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        stop_ids = tuple(dict.fromkeys((*eos, *(params.stop_token_ids or ()))))
        state = _RequestState(request_id, text, token_ids, params, self.tokenizer)
        speculate = speculative and self.speculative is not None and _can_speculate(params)
        if speculate:
            state.speculative = SpecStats()
        children = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                # vLLM's rule: sample i of a seeded request uses seed + i, so the samples
                # differ from each other yet each is reproducible.
                child_params = dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + index)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(Request(
                child_id, token_ids, child_params, max_tokens=params.max_tokens,
                eos_token_ids=stop_ids, cache_salt=cache_salt,
                skip_prefix_cache=params.prompt_logprobs is not None, speculate=speculate))
        if params.n > 1 and self.config.enable_prefix_caching:
            children, state.deferred = children[:1], children[1:]
        for child in children:
            self.scheduler.add_request(child)
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            self._children[child_id] = (state, index)
        self._requests[request_id] = state

    def _tokenize(self, request_id: str, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or ("prompt" not in prompt and "prompt_token_ids" not in prompt):
                raise ValueError(f"request {request_id!r}: a prompt dict takes 'prompt' (text) "
                                 f"and/or 'prompt_token_ids', got keys {sorted(prompt)}")
            if "prompt_token_ids" not in prompt:
                return self._tokenize(request_id, prompt["prompt"])
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"request {request_id!r}: 'prompt' must be text")
            return text, self._tokenize(request_id, prompt["prompt_token_ids"])[1]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: a text prompt needs a tokenizer; "
                                 "this engine has none, pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        try:
            if isinstance(prompt, bytes) or any(isinstance(token, bool | float)
                                                for token in prompt):
                raise TypeError
            token_ids = [int(token) for token in prompt]
        except (TypeError, ValueError):
            raise ValueError(f"request {request_id!r}: the prompt must be a string or a list "
                             "of token ids") from None
        return None, token_ids

    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        for what, ids in (("prompt token ids", token_ids),
                          ("stop_token_ids", params.stop_token_ids or ()),
                          ("logit_bias token ids", (params.logit_bias or {}).keys())):
            bad = [token for token in ids if not 0 <= token < vocab]
            if bad:
                raise ValueError(f"request {request_id!r}: {what} {bad[:5]} are outside the "
                                 f"vocabulary [0, {vocab})")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(token_ids)} tokens leaves "
                             f"no room for output within max_model_len = "
                             f"{self.config.max_model_len}")
        if params.prompt_logprobs is not None and not self.config.enable_prompt_logprobs:
            raise ValueError(f"request {request_id!r}: prompt_logprobs needs an engine built "
                             "with enable_prompt_logprobs=True")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer; this "
                             "engine has none (use stop_token_ids)")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops every sample of a request now and frees their pages.

        Returns:
            The request's final output (unfinished samples end with finish_reason "abort"),
            or None if the request was not unfinished (unknown or already done).
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        for index, sample in enumerate(state.samples):
            child_id = request_id if state.params.n == 1 else f"{request_id}#{index}"
            self.scheduler.abort_request(child_id)
            self._children.pop(child_id, None)
            if self.proposer is not None:
                self.proposer.release([child_id])
            if not sample.finished:
                sample.finish_reason = "abort"
        state.deferred = []
        return state.output()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or has samples not yet admitted."""
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests added and neither finished nor aborted."""
        return len(self._requests)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step.

        Returns:
            A cumulative RequestOutput for each request that got tokens or finished.
        """
        scheduled = self.scheduler.schedule(self._propose_drafts())
        self.num_preemptions += len(scheduled.preempted_request_ids)
        if scheduled.is_empty:
            return []
        result = self.runner.execute(scheduled.scheduled_requests)
        self.num_steps += 1
        for child_id, chunk in result.prompt_logprobs.items():
            self._children[child_id][0].add_prompt_logprobs(chunk)
        new_tokens = {child_id: [sampled.token_id]
                      for child_id, sampled in result.sampled.items()}
        new_tokens.update(result.speculated)
        outputs = self.scheduler.update_from_output(scheduled, new_tokens)
        touched: dict[str, _RequestState] = {}
        for output in outputs:
            state, index = self._children[output.request_id]
            if state.speculative is not None:
                state.speculative.add(output.num_draft_tokens, output.num_accepted_tokens)
                self.spec_stats.add(output.num_draft_tokens, output.num_accepted_tokens)
            logprobs = None
            if state.params.logprobs is not None and output.new_token_ids:
                sampled: SampledToken = result.sampled[output.request_id]
                top = state.params.logprobs
                logprobs = [_logprob_dict(sampled.token_id, sampled.logprob,
                                          sampled.top_token_ids[:top],
                                          sampled.top_logprobs[:top])]
            if state.samples[index].add(output.new_token_ids, output.finish_reason, logprobs):
                self.scheduler.abort_request(output.request_id)  # a stop string matched
            if state.samples[index].finished:
                del self._children[output.request_id]
                if self.proposer is not None:
                    self.proposer.release([output.request_id])
            if state.deferred:
                # The first sample has its first token, so its prompt blocks are cached.
                for child in state.deferred:
                    self.scheduler.add_request(child)
                state.deferred = []
            touched[state.request_id] = state
        for request_id, state in touched.items():
            if state.finished:
                del self._requests[request_id]
        return [state.output() for state in touched.values()]

    def _propose_drafts(self) -> dict[str, Draft] | None:
        """The proposer's drafts for the speculating, decoding requests' coming step."""
        if self.proposer is None:
            return None
        decoding = [request for request in self.scheduler.running
                    if request.speculate and _is_decoding(request)]
        return self.proposer.propose(decoding) if decoding else {}

    # ------------------------------------------------------------------ metrics

    def stats(self) -> EngineStats:
        """A snapshot of the engine's load, for a server's metrics and admission control."""
        manager = self.scheduler.kv_cache_manager
        usable = self.config.num_pages - 1  # the null page is never handed out
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=1.0 - manager.num_free_blocks / usable,
            prefix_cache_hit_rate=manager.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions, num_steps=self.num_steps,
            num_spec_steps=self.spec_stats.num_spec_steps,
            num_draft_tokens=self.spec_stats.num_draft_tokens,
            num_accepted_tokens=self.spec_stats.num_accepted_tokens)

    @property
    def num_free_pages(self) -> int:
        """Pages free or evictable (the pool's capacity when the engine is idle)."""
        return self.scheduler.kv_cache_manager.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served by the prefix cache."""
        return self.scheduler.kv_cache_manager.prefix_cache_hit_rate
