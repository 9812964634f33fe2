"""The synchronous engine loop: schedule -> propose -> execute -> update.

    engine = build_engine(model, EngineConfig.from_options(max_num_seqs=16), tokenizer)
    engine.add_request("a", "The list type", SamplingParams(max_tokens=32, stop=["\\n\\n"]))
    while engine.has_unfinished_requests():
        for output in engine.step():
            ...  # a jaxinfer.engine.outputs.RequestOutput (cumulative by default)

`step()` is vLLM v1's loop body, in four parts that each live in their own module:

1. propose: the speculating, decoding requests get drafts (`jaxinfer.engine.spec`);
2. schedule: `Scheduler.schedule()` decides which tokens of which requests to compute within
   the token budget (`jaxinfer.engine.host`);
3. execute: `ModelRunner.execute` packs them, runs the jitted step over the paged cache,
   samples and verifies drafts (`jaxinfer.engine.device`);
4. update: `Scheduler.update_from_output` appends the tokens, stops requests on stop tokens and
   lengths, rolls back rejected drafts and releases pages; then `OutputProcessor` detokenizes,
   finds stop strings, gathers logprobs and builds the outputs (`output_processor`).

A failure in one request's host work inside a step fails that request alone: when packing
the step's inputs (its sampling arrays, block table, drafts) raises because of some requests,
the runner names them (`RequestsFailedError`), the engine ends them with finish_reason "error"
(`RequestOutput.error` says why; their pages are freed) and runs the step without them; the
output processor does the same for detokenizing, stop strings and logprobs. The step itself
(the device program) failing is no request's fault: it raises, and the engine is dead.

Requests enter through `InputProcessor` (every check, n > 1 fan-out), which raises
`RequestError` naming the field before anything is queued. The scheduler never touches device
arrays and the runner never makes scheduling decisions.

Speculative decoding (`speculative={"method": "ngram", "num_tokens": R, "max_ngram": n}` or
`{"method": "draft_model", "model": ..., "num_tokens": R}`): a request speculates unless it
opts out (`speculative=False`) or asks for something that changes per position or needs
per-token results (logprobs, prompt logprobs, penalties, structured output); it drafts
nothing while min_tokens still holds stop tokens back.

Structured output (`SamplingParams.structured_outputs`): each sample of a constrained request
carries an llguidance matcher (`jaxinfer.engine.structured_output`); the runner asks it for
the allowed tokens of every step in which the request samples (a packed bitmask row of the
step's fixed-shape input), the engine advances it with each sampled token, and the scheduler
stops the request ("stop") once the grammar is complete. A token the matcher refuses fails
that request alone. Speculating and plain requests share every batch. A seeded
speculating request samples exactly from the target's distribution and repeats itself when run
the same way, but its draws depend on which drafts were verified, so (unlike a plain seeded
request) its tokens can change when a crowded batch's token budget trims its drafts.

With `adaptive` speculation (the default), a `ThroughputGate` first decides whether the step
speculates at all, per regime (batch bucket, whether any request samples), from the measured
output tokens per second of whole decode-only steps with speculation on and off
(`jaxinfer.engine.spec.gate`); off, the proposer is not called. On, a `SpecController`
decides how many drafts (0 .. R) each decoding request gets, from the request's measured
acceptance and the measured cost of the step's token bucket and of the drafter
(`jaxinfer.engine.spec.controller`); only requests granted drafts are proposed for, and
their drafts are cut to the grant. The engine feeds them every verification's outcome and
every step's wall times, and `warm_up` times each token bucket once to start the cost model.

Host KV tier (`kv_offload_bytes` > 0, `jaxinfer.engine.device.kv_offload`): each step first
collects the previous step's copies to host memory (so prefix lookups see them), then, after
scheduling, issues the step's planned copies (evicted pages out, host hits back in) before
the step runs.

A request with `n > 1` becomes n scheduler requests ("ID#0", "ID#1", ...). With prefix caching
on, the first one runs alone until its prompt is computed, and the others are admitted after
it, so they find every full prompt block in the prefix cache and share those pages (reference
counted) instead of computing and storing the prompt n times.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import logging
import time

from jax.sharding import Mesh

from jaxinfer.compilation_cache import enable_compilation_cache
from jaxinfer.engine.client import ITERATION_TOKEN_BUCKETS, EngineStats
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.device.kv_offload import KVOffloader
from jaxinfer.engine.device.runner import (
    ModelRunner,
    RequestsFailedError,
    RunnerConfig,
    RunnerOutput,
)
from jaxinfer.engine.device.step_io import STEP
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.host.draft import Draft, SpecStats
from jaxinfer.engine.host.request import Request
from jaxinfer.engine.host.scheduler import ScheduledRequest, Scheduler
from jaxinfer.engine.input_processor import InputProcessor, ProcessedRequest, Prompt
from jaxinfer.engine.output_processor import OutputProcessor, describe_failure
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams
from jaxinfer.engine.spec.controller import SpecController
from jaxinfer.engine.spec.gate import Regime, ThroughputGate, regime_of
from jaxinfer.engine.spec.proposer import Proposer, build_proposer
from jaxinfer.models import Transformer
from jaxinfer.multihost import StepChannel
from jaxinfer.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "EngineStats", "Prompt", "runner_config"]

logger = logging.getLogger(__name__)


def runner_config(config: EngineConfig) -> RunnerConfig:
    """The device step's static sizes for a resolved engine config (the one place they are
    taken from it)."""
    speculative = config.speculative
    return RunnerConfig(
        num_pages=config.num_pages, page_size=config.cache.page_size,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs, max_model_len=config.max_model_len,
        cache_dtype=config.cache.page_dtype,
        min_token_bucket=config.compile.min_token_bucket,
        enable_prompt_logprobs=config.compile.enable_prompt_logprobs,
        bucket_growth=config.compile.bucket_growth,
        num_speculative_tokens=speculative.num_tokens if speculative else 0,
        draft_distributions=speculative is not None and speculative.method == "draft_model")


def _is_decoding(request: Request) -> bool:
    """Whether the request's next step feeds only its last token (no prefill left), and
    min_tokens no longer holds stop tokens back (it would change per draft position)."""
    return (request.num_computed_tokens == request.num_tokens - 1
            and request.num_output_tokens >= request.sampling_params.min_tokens)


def _samples(params: SamplingParams | None) -> bool:
    """Whether a request samples (temperature > 0) rather than taking the argmax."""
    return params is not None and params.temperature >= GREEDY_TEMPERATURE_EPS


def _cut(draft: Draft, num_tokens: int) -> Draft:
    """The draft's first `num_tokens` tokens (and distributions)."""
    if len(draft.token_ids) <= num_tokens:
        return draft
    return Draft(draft.token_ids[:num_tokens],
                 None if draft.probs is None else draft.probs[:num_tokens])  # [k, V]


class Engine:
    """Continuous batching over one model: add requests at any time, call `step()`."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, *,
                 draft_model: Transformer | None = None, mesh: Mesh | None = None,
                 proposer: Proposer | None = None, step_channel: StepChannel | None = None,
                 channel_tag: int = 0) -> None:
        """Builds the scheduler, the page pool and the jitted step (not yet compiled).

        Args:
            model: The model to serve, already placed on `mesh` if one is given.
            config: Engine options (`EngineConfig.from_options(...)` takes vLLM's names).
            tokenizer: For text prompts, output text and stop strings; None serves token ids.
            draft_model: The drafter for `speculative={"method": "draft_model", ...}`, if
                already built; None loads the config's `model` name.
            mesh: The replica's device mesh (see `jaxinfer.engine.parallel`); None: one
                device. The page pool is split over it like the model's KV heads.
            proposer: Drafts tokens in place of the one `speculative` names (which still
                sets how many are verified, and whether drafts carry distributions).
            step_channel: A multi-host leader's end of the step channel: every step's inputs
                go down it, tagged `channel_tag` (the replica index), before the step runs
                (`jaxinfer.engine.multihost_steps`).
            channel_tag: This replica's index among the engine's replicas.

        Raises:
            ValueError: An invalid config (the field is named), a drafter whose
                vocabulary differs from the target's, or a proposer without `speculative`.
        """
        config = (config or EngineConfig()).resolved(model.config.max_position_embeddings)
        if config.parallel.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size = {config.parallel.data_parallel_size}: an "
                             "Engine is one replica; build replicas with "
                             "jaxinfer.engine.factory.load_engine or DataParallelEngine")
        self.config = config
        self.model = model
        self.model_config = model.config
        self.tokenizer = tokenizer
        if step_channel is not None and config.speculative is not None and (
                config.speculative.method == "draft_model"):
            # The drafter's steps run on process 0's devices only.
            raise ValueError("speculative decoding with a draft model is not supported across "
                             "several processes yet; use the ngram method")
        # Before anything compiles: a warm cache turns warm-up into reading programs back.
        self.compilation_cache = enable_compilation_cache(config.compile.compilation_cache)
        self.runner = ModelRunner(model, runner_config(config), mesh=mesh,
                                  channel=step_channel, channel_tag=channel_tag)
        self.kv_offload: KVOffloader | None = None
        if config.cache.kv_offload_bytes:
            if step_channel is not None:
                raise ValueError("kv_offload_bytes: the host KV tier is not supported across "
                                 "several processes yet (the followers' pools would not get "
                                 "the copies)")
            self.kv_offload = KVOffloader(self.runner, config.cache.kv_offload_bytes)
        self.scheduler = Scheduler(
            config.scheduler, config.cache,
            None if self.kv_offload is None else self.kv_offload.host_pool)
        self.speculative = config.speculative
        self.spec_stats = SpecStats()
        # Steps by the tokens they ran (`EngineStats.iteration_tokens`).
        self._iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._iteration_tokens_sum = 0
        # Wall seconds of each part of `step`: drafting, scheduling, the runner (its own
        # `seconds` split it into host packing and device time) and output processing; of
        # "outputs", the part spent advancing structured-output matchers ("grammars").
        self.seconds = dict.fromkeys(("propose", "schedule", "execute", "outputs",
                                      "grammars"), 0.0)
        if proposer is not None and self.speculative is None:
            raise ValueError("a proposer needs speculative options (num_tokens at least)")
        self.proposer: Proposer | None = proposer if proposer is not None else build_proposer(
            self.speculative, model, self.runner.config, draft_model=draft_model)
        speculative = self.speculative
        self.spec_controller: SpecController | None = (
            SpecController(speculative.num_tokens, self.runner.config.token_buckets,
                           self.runner.config.sequence_buckets, speculative.probe_fraction)
            if speculative is not None and speculative.adaptive else None)
        # Above the controller: whether a step speculates at all, from measured throughput.
        self.spec_gate: ThroughputGate | None = (
            ThroughputGate(speculative.probe_fraction)
            if self.spec_controller is not None else None)
        self._gated: tuple[Regime, bool] | None = None  # this step's regime and gate choice
        self.input_processor = InputProcessor(model.config, config, tokenizer,
                                              speculative=self.speculative is not None)
        self.output_processor = OutputProcessor(tokenizer)
        # Samples 1..n-1 of an n > 1 request wait here, under sample 0's id, until sample 0's
        # prompt is cached.
        self._deferred: dict[str, list[Request]] = {}
        self.num_steps = 0
        self.num_preemptions = 0

    @property
    def runners(self) -> list[ModelRunner]:
        """The engine's device runners (one: this engine is one replica)."""
        return [self.runner]

    def warm_up(self) -> float:
        """Compiles every bucket of the device step (and the proposer's), and with adaptive
        speculation times each bucket once for the controller's cost model; returns seconds."""
        started = time.perf_counter()
        self.runner.warm_up()
        if self.kv_offload is not None:
            self.kv_offload.warm_up()
        if self.proposer is not None:
            self.proposer.warm_up()
        if self.spec_controller is not None:
            self.spec_controller.bootstrap(self.runner.time_steps())
            # A proposer with device work may time it too (the draft model does).
            time_drafts = getattr(self.proposer, "time_drafts", None)
            if time_drafts is not None:
                self.spec_controller.draft_costs.bootstrap(time_drafts())
        # What loading and compiling made (modules, traced programs, tokenizer tables) lives
        # as long as the engine: moved out of the collector's view, later collections scan
        # only what the steps make (a full collection over it showed in decode profiles).
        gc.freeze()
        return time.perf_counter() - started

    @property
    def compilations(self) -> int:
        """Programs compiled so far, the proposer's included (constant after `warm_up`)."""
        return self.runner.compilations + (
            self.proposer.compilations if self.proposer is not None else 0) + (
            self.kv_offload.compilations if self.kv_offload is not None else 0)

    # ------------------------------------------------------------------ requests

    def process_request(self, request_id: str, prompt: Prompt,
                        sampling_params: SamplingParams | None = None, *,
                        cache_salt: str | None = None,
                        speculative: bool = True) -> ProcessedRequest:
        """Checks a request and builds its scheduler requests without queuing them.

        Touches no engine state, so it may run on any thread (see `InputProcessor.process`).

        Raises:
            RequestError: The field at fault is named.
        """
        return self.input_processor.process(request_id, prompt, sampling_params,
                                            cache_salt=cache_salt, speculative=speculative)

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Queues a checked request; it joins the running batch at the next step with room.

        Raises:
            RequestError: The id is already in use by an unfinished request.
        """
        request_id = processed.request_id
        if request_id in self.output_processor:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        self.output_processor.add_request(processed)
        samples = processed.samples
        if len(samples) > 1 and self.config.cache.enable_prefix_caching:
            self._deferred[samples[0].request_id] = samples[1:]
            samples = samples[:1]
        for sample in samples:
            self.scheduler.add_request(sample)

    def add_request(self, request_id: str, prompt: Prompt,
                    sampling_params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, speculative: bool = True) -> None:
        """Checks and queues a request; it joins the running batch at the next step with room.

        Args:
            request_id: Unique among unfinished requests.
            prompt: Text (needs the tokenizer; BOS is added as the tokenizer does), token
                ids, or a dict with "prompt_token_ids" and optionally the "prompt" text they
                came from (e.g. a rendered chat), or with "prompt" only.
            sampling_params: How to sample, when to stop and what outputs to report; None is
                `SamplingParams()`.
            cache_salt: Keeps this request's prefix-cache blocks apart from other salts.
            speculative: False opts the request out of the engine's speculative decoding
                (it has no effect on an engine without it, or on a request that cannot
                speculate, see the module docstring).

        Raises:
            RequestError: (a ValueError) naming the field: a duplicate id, an empty prompt, a
                token id outside the vocabulary (prompt, logit_bias or stop_token_ids), a
                prompt that leaves no room for output within max_model_len, prompt logprobs
                while they are disabled, or text without a tokenizer. Nothing is queued then.
        """
        self.add_processed_request(self.process_request(
            request_id, prompt, sampling_params, cache_salt=cache_salt,
            speculative=speculative))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops every sample of a request now and frees their pages.

        Returns:
            The request's final output (unfinished samples end with finish_reason "abort"),
            or None if the request was not unfinished (unknown or already done).
        """
        return self._end_request(request_id)

    def _end_request(self, request_id: str, error: str | None = None
                     ) -> RequestOutput | None:
        """`abort_request`, or with `error` the request failed alone (finish_reason
        "error")."""
        output, sample_ids = self.output_processor.abort(request_id, error=error)
        if sample_ids:
            self._deferred.pop(sample_ids[0], None)
        self.scheduler.abort_requests(sample_ids)
        self.runner.release(sample_ids)
        if self.proposer is not None:
            self.proposer.release(sample_ids)
        if self.spec_controller is not None:
            self.spec_controller.release(sample_ids)
        if self.kv_offload is not None and not self.has_unfinished_requests():
            self.kv_offload.collect()  # idle now: no next step would collect the copies
        return output

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or has samples not yet admitted."""
        return len(self.output_processor) > 0

    @property
    def num_unfinished_requests(self) -> int:
        """Requests added and neither finished nor aborted."""
        return len(self.output_processor)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step.

        Returns:
            An output for each request that got tokens or finished, shaped by its
            `output_kind` (cumulative, delta, or final only).
        """
        started = time.perf_counter()
        self._gated = None
        if self.kv_offload is not None:
            self.kv_offload.collect()  # the previous step's evicted blocks become findable
        drafts = self._propose_drafts()
        proposed = time.perf_counter()
        scheduled = self.scheduler.schedule(drafts)
        self.num_preemptions += len(scheduled.preempted_request_ids)
        if scheduled.kv_transfers:
            # Before the step, which may overwrite evicted pages and reads the loaded ones.
            self.kv_offload.issue(scheduled.kv_transfers)
        if scheduled.is_empty:
            return []
        self.output_processor.scheduled(
            sequence.request_id for sequence in scheduled.scheduled_requests)
        self._iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS,
                                                  scheduled.num_scheduled_tokens)] += 1
        self._iteration_tokens_sum += scheduled.num_scheduled_tokens
        executing = time.perf_counter()
        result, sequences, failed_outputs = self._execute(scheduled.scheduled_requests)
        executed = time.perf_counter()
        self.num_steps += 1
        new_tokens = {sample_id: [sampled.token_id]
                      for sample_id, sampled in result.sampled.items()}
        new_tokens.update(result.speculated)
        advancing = time.perf_counter()
        failed_outputs += self._advance_grammars(sequences, new_tokens)
        self.seconds["grammars"] += time.perf_counter() - advancing
        updates = self.scheduler.update_from_output(scheduled, new_tokens)
        controller = self.spec_controller
        for update in updates:
            self.spec_stats.add(update.num_draft_tokens, update.num_accepted_tokens)
            if controller is not None:
                controller.observe_verification(update.request_id, update.num_draft_tokens,
                                                update.num_accepted_tokens)
        outputs, stopped, finished, failed = self.output_processor.process(
            updates, result.sampled, result.prompt_logprobs)
        outputs = failed_outputs + outputs
        for sample_id in stopped:
            self.scheduler.abort_request(sample_id)  # a stop string matched, or it failed
        for sample_id in failed:
            self._deferred.pop(sample_id, None)
        if finished or stopped:
            self.runner.release([*finished, *stopped])  # a KIVI pool's residual seats
        if self.proposer is not None and finished:
            self.proposer.release(finished)
        if controller is not None and finished:
            controller.release(finished)
        for update in updates:
            # Sample 0 has its first token, so its prompt blocks are cached: admit the rest.
            for sample in self._deferred.pop(update.request_id, ()):
                if self.output_processor.tracks(sample.request_id):
                    self.scheduler.add_request(sample)
        if self.kv_offload is not None:
            # Whatever has arrived is committed now, off the next step's path; once idle,
            # everything (nothing would collect it otherwise).
            self.kv_offload.collect(wait=not self.has_unfinished_requests())
        finished_at = time.perf_counter()
        self.seconds["propose"] += proposed - started
        self.seconds["schedule"] += executing - proposed
        self.seconds["execute"] += executed - executing
        self.seconds["outputs"] += finished_at - executed
        if controller is not None and sequences and self.runner.step_kind(sequences) == STEP:
            controller.observe_step(
                scheduled.num_scheduled_tokens,
                any(request.spec_token_ids for request in scheduled.scheduled_requests),
                executed - executing, (executing - proposed) + (finished_at - executed),
                sampled=any(_samples(request.sampling_params)
                            for request in scheduled.scheduled_requests))
        if self._gated is not None and all(
                request.needs_sample and len(request.token_ids) == 1 + len(request.spec_token_ids)
                for request in scheduled.scheduled_requests):
            # A decode-only step: its output tokens per whole-step second measure the mode.
            regime, speculated = self._gated
            self.spec_gate.observe(regime, speculated,
                                   sum(len(update.new_token_ids) for update in updates),
                                   finished_at - started)
        return outputs

    def _execute(self, sequences: list[ScheduledRequest]
                 ) -> tuple[RunnerOutput, list[ScheduledRequest], list[RequestOutput]]:
        """Runs the step; requests whose inputs alone cannot be packed fail and the step
        runs without them (the scheduler ignores aborted requests' missing tokens).

        Returns:
            The runner's output, the requests it ran, and the failed requests' final outputs.
        """
        failed_outputs: list[RequestOutput] = []
        while True:
            try:
                return self.runner.execute(sequences), sequences, failed_outputs
            except RequestsFailedError as failure:
                for sample_id, error in failure.errors.items():
                    request_id = self.output_processor.parent_of(sample_id)
                    if request_id is None:  # a sibling sample's failure already ended it
                        self.scheduler.abort_request(sample_id)  # (a no-op then)
                        continue
                    logger.error("request %r failed; the others carry on", request_id,
                                 exc_info=error)
                    output = self._end_request(request_id, describe_failure(error))
                    if output is not None:
                        failed_outputs.append(output)
                # Every sample of a failed request is gone, not only the failing ones.
                sequences = [sequence for sequence in sequences
                             if self.scheduler.get_request(sequence.request_id) is not None]

    def _advance_grammars(self, sequences: list[ScheduledRequest],
                          new_tokens: dict[str, list[int]]) -> list[RequestOutput]:
        """Advances each constrained request's matcher past its new tokens (the scheduler
        then stops the requests whose grammar is complete).

        The device masked every token the grammar forbids, so a token the matcher refuses is
        a fault of this request alone (e.g. a mask that allowed nothing): it fails, and the
        others carry on.

        The live matchers' next masks are then computed on the grammar worker thread while
        this thread processes the outputs and prepares the next step.

        Returns:
            The failed requests' final outputs.
        """
        failed = []
        advanced = []
        for sequence in sequences:
            grammar = sequence.grammar
            tokens = new_tokens.get(sequence.request_id)
            if grammar is None or not tokens:
                continue
            refused = next((token for token in tokens if not grammar.accept(token)), None)
            if refused is None:
                advanced.append(grammar)
                continue
            request_id = self.output_processor.parent_of(sequence.request_id)
            if request_id is None:  # a sibling sample's failure already ended it
                continue
            logger.error("request %r: token %d breaks its structured output (%s)",
                         request_id, refused, grammar.error)
            output = self._end_request(request_id, "the output broke its structured-output "
                                                   "grammar")
            if output is not None:
                failed.append(output)
        if advanced:
            self.input_processor.grammars.prefetch_masks(advanced)
        return failed

    def _propose_drafts(self) -> dict[str, Draft] | None:
        """The proposer's drafts for the speculating, decoding requests' coming step (with
        adaptive speculation: none when the throughput gate keeps the step plain, else for
        the requests the controller grants drafts, cut to the grant)."""
        if self.proposer is None:
            return None
        decoding = [request for request in self.scheduler.running
                    if request.speculate and _is_decoding(request)]
        if not decoding:
            return {}
        if self.spec_controller is None:
            return self.proposer.propose(decoding)
        running = self.scheduler.running
        emitting = sum(1 for request in running
                       if request.num_computed_tokens == request.num_tokens - 1)
        sampled = any(_samples(request.sampling_params) for request in running)
        regime = regime_of(emitting, sampled)
        speculate = self.spec_gate.speculate(regime)
        self._gated = regime, speculate
        if not speculate:
            return {}  # plain decoding this step: the proposer is not called at all
        grants = self._plan_drafts(decoding, emitting, sampled)
        chosen = [request for request in decoding if request.request_id in grants]
        if not chosen:
            return {}
        started = time.perf_counter()
        drafts = self.proposer.propose(chosen, num_tokens=grants)
        self.spec_controller.observe_drafts(len(chosen), max(grants.values()),
                                            time.perf_counter() - started)
        return {request_id: _cut(draft, grants[request_id])
                for request_id, draft in drafts.items()}

    def _plan_drafts(self, decoding: list[Request], emitting: int, sampled: bool
                     ) -> dict[str, int]:
        """The controller's draft grant per decoding request, from the step's shape: the
        running requests' own tokens, the prompts waiting for a free seat, the budget
        (`emitting`: running requests that sample this step; `sampled`: any of them at
        temperature > 0)."""
        config = self.config.scheduler
        running = self.scheduler.running
        own = sum(request.num_tokens - request.num_computed_tokens for request in running)
        seats = max(config.max_num_seqs - len(running), 0)
        waiting = sum(request.num_tokens - request.num_computed_tokens
                      for request in itertools.islice(self.scheduler.waiting, seats))
        limit = self.speculative.num_tokens
        room = {request.request_id: min(limit, self.scheduler.draft_room(request))
                for request in decoding}
        return self.spec_controller.plan(
            room, num_tokens=own + waiting, num_emitting=emitting,
            max_drafts=config.max_num_batched_tokens - min(own, config.max_num_batched_tokens),
            sampled=sampled)

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
            num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            num_free_pages=manager.num_free_blocks,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_unfinished_requests=self.num_unfinished_requests,
            accepted_per_position=tuple(self.spec_stats.accepted_per_position),
            iteration_tokens=tuple(self._iteration_tokens),
            iteration_tokens_sum=self._iteration_tokens_sum,
            **self._host_tier_stats())

    def _host_tier_stats(self) -> dict[str, int | float]:
        """The host KV tier's `EngineStats` fields (none without it: they stay 0)."""
        offload = self.kv_offload
        if offload is None:
            return {}
        manager = self.scheduler.kv_cache_manager
        host = offload.host_pool
        return dict(host_cache_queries=host.num_lookups, host_cache_hits=host.num_hits,
                    host_cache_hit_tokens=manager.host_hit_tokens,
                    num_host_blocks=host.num_blocks, num_free_host_blocks=host.num_free_blocks,
                    num_swapped_blocks=manager.num_swapped_blocks,
                    kv_bytes_to_host=offload.bytes_to_host,
                    kv_bytes_to_device=offload.bytes_to_device,
                    kv_copy_seconds=offload.copy_seconds,
                    kv_copy_blocked_seconds=offload.seconds["blocked"])

    @property
    def num_free_pages(self) -> int:
        """Pages free or evictable (the pool's capacity when the engine is idle)."""
        return self.scheduler.kv_cache_manager.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served by the prefix cache."""
        return self.scheduler.kv_cache_manager.prefix_cache_hit_rate
