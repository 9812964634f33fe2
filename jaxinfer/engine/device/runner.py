"""The device side of the engine: one jitted step over a padded, bucketed ragged batch.

Each step receives, from the scheduler, the new tokens of every scheduled request (a prefill
chunk or one decode token), where they sit (start position, block table) and whether a token
must be sampled after them (`jaxinfer.engine.host.scheduler.ScheduledRequest`). The runner packs
them into one `[1, T]` row (T rounded up to a token bucket; the per-sequence arrays padded to
Q = min(T, max_num_seqs) rows, every block table to `pages_per_sequence` with the null page 0),
runs the model over the paged cache (donated, so it is updated in place), and samples one
token per request from the logits of its last token, on device, with per-request
parameters and per-request PRNG keys.

The host side and the device side meet in two typed tuples (`jaxinfer.engine.device.step_io`;
shape letters as in `jaxinfer/typing.py`): `prepare` packs the scheduled requests into
`StepInputs`, `run` runs the jitted step on them and returns `StepOutputs`, and `execute` does
both and unpacks the results per request for the engine. A multi-host leader's runner sends
each step's kind and `StepInputs` to the followers before running it; they call `run`.

Speculative decoding (`num_speculative_tokens` = R > 0): a request's step may end with up to R
draft tokens (`ScheduledRequest.spec_token_ids`). The step then also takes the logits at its
last known token and at each draft (`[Q, R + 1, V]`, one lm-head pass over Q * (R + 1) gathered
rows, skipped when no request has drafts) and verifies the drafts on device with exact
speculative sampling (`jaxinfer.engine.spec.verify.verify`); drafts are `[Q, R]` arrays with a
per-row count, so the step's shapes, and its compiled programs, stay those of its buckets.

Shapes depend only on the token bucket (Q follows from T, as in tpu-inference), so there is
one program per token bucket: `warm_up` lowers each and compiles them concurrently, and the
engine never compiles again; `compilations` counts the programs to prove it. The step that also
returns prompt logprobs is a second kind of program, compiled for a bucket the first time a
request asks for them (it is rare, and compiling it for every bucket would double warm-up).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.engine.device.runner_config import (  # noqa: F401 (re-exported)
    RunnerConfig,
    bucket_for,
    power_of_two_buckets,
)
from jaxinfer.engine.device.sampler import (
    SamplingArrays,
    build_sampling_arrays,
    greedy_rows,
    prompt_logprobs,
    prompt_top_logprobs,
    sample_tokens,
    unconstrained_bitmask,
)
from jaxinfer.engine.device.step_io import (  # the result types are re-exported from here
    PROMPT_STEP,
    STEP,
    STEP_KINDS,
    PromptLogprobs,
    RequestsFailedError,
    RunnerOutput,
    SampledToken,
    StepInputs,
    StepOutputs,
)
from jaxinfer.engine.host.scheduler import ScheduledRequest
from jaxinfer.engine.spec.verify import Verification, sampling_probabilities, verify
from jaxinfer.kv_formats import KIVI_BITS
from jaxinfer.models import PagedBatch, PagedKVCache, Transformer
from jaxinfer.models.attention import scale_spec
from jaxinfer.models.scan import can_stack_layers, stack_layers
from jaxinfer.multihost import StepChannel
from jaxinfer.sharding import activate, active_axis, parameter_shardings
from pallas_kernels.ragged_paged_attention import KiviPool


class ModelRunner:
    """Owns the model, the page pool and the compiled steps.

    There are two step programs per token bucket: the plain one, and one that also computes
    the logits of every fed token for requests that asked for prompt logprobs (an lm-head
    over the whole chunk, which the plain step avoids). The second is only allowed with
    `enable_prompt_logprobs`, and compiled on first use.
    """

    def __init__(self, model: Transformer, config: RunnerConfig, *, mesh: Mesh | None = None,
                 layout: str = "tensor_parallel", channel: StepChannel | None = None,
                 channel_tag: int = 0, abstract: bool = False, scan_layers: bool = True
                 ) -> None:
        """Builds the page pool and the jitted steps (not yet compiled).

        Args:
            model: The model, already placed on `mesh` under `layout` when one is given.
            config: The step's static sizes.
            mesh: The devices the model is sharded over (None: one device). The page pool
                is split over the mesh axis that splits KV heads, so each device holds the
                pages of its own heads; inputs are replicated and outputs gathered.
            layout: The sharding layout the model was placed with.
            channel: The leader's end of a multi-host step channel: every step's inputs go
                down it before the step runs; None: a single process.
            channel_tag: This runner's replica index, sent with each step so a follower
                hands it to the same replica's runner.
            abstract: `model` is abstract (`nnx.eval_shape`, as `abstract_model` builds it)
                and nothing is allocated: the state and page pool are `ShapeDtypeStruct`s
                carrying their shardings, and the runner can only `lower` its steps. This is
                how a step is compiled ahead of time for devices that are described, not
                attached (`jaxinfer.engine.aot`).
            scan_layers: Run the blocks as one `lax.scan` over their stacked weights when
                they allow it (`jaxinfer.models.scan`); False unrolls them, e.g. to read one
                layer's cost off programs of different depths.
        """
        self.config = config
        self.model_config = model.config
        self.mesh = mesh
        self.layout = layout
        self.abstract = abstract
        self.graphdef, self.state = self._split_model(model, scan_layers)
        if abstract:
            self.state = self._placed_abstract_state()
        # scales: None for a float pool, [L, P, Z, 2K] for an 8-bit one, a KiviPool for KIVI
        self.pages, self.scales = self._allocate_pages()
        self._kivi = config.cache_dtype in KIVI_BITS
        # KIVI: each running request's seat in the residual pool (its partial last page).
        self._seats: dict[str, int] = {}
        self._free_seats = list(range(config.max_num_seqs))
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        if channel is not None and not channel.is_leader:
            raise ValueError("a runner leads with the leader's end of the step channel")
        self._channel = channel
        self._channel_tag = channel_tag
        # On a mesh the outputs' placement is pinned: the pool keeps its own sharding (so
        # the donated buffers are reused and every call after the first sees the inputs the
        # program was compiled for), and the results are replicated for every process.
        out_shardings = None if mesh is None else (
            jax.tree.map(lambda array: array.sharding, self.pages),
            jax.tree.map(lambda array: array.sharding, self.scales), self._replicated)
        self._step = jax.jit(functools.partial(self._device_step, with_prompt_logprobs=False),
                             donate_argnums=(1, 2), out_shardings=out_shardings)
        self._prompt_step = jax.jit(
            functools.partial(self._device_step, with_prompt_logprobs=True),
            donate_argnums=(1, 2), out_shardings=out_shardings)
        self._steps = {STEP: self._step, PROMPT_STEP: self._prompt_step}
        # (kind, token bucket) -> its compiled program; `run` calls these, not the jit wrappers,
        # so that a program compiled in a warm-up thread is the one that runs.
        self._programs: dict[tuple[str, int], jax.stages.Compiled] = {}
        # Per Q: the all-zero `[Q, R, V]` draft distributions of a step without drafts.
        self._no_draft_probs: dict[int, np.ndarray | jax.Array] = {}
        self.warm_up_seconds: float | None = None
        # Wall seconds `execute` spent packing inputs on the host ("prepare") and running the
        # step until its results were back on the host ("device"); of "prepare", the part
        # spent taking the structured-output masks ("masks", waits for the worker included).
        self.seconds = {"prepare": 0.0, "device": 0.0, "masks": 0.0}

    def _split_model(self, model: Transformer,
                     scan_layers: bool) -> tuple[nnx.GraphDef, nnx.State]:
        """The graph and state the steps run: those of the model with its blocks stacked
        (`jaxinfer.models.scan.stack_layers`: the step scans one block over the layers, so
        its compile time does not grow with depth), or of the model as given when its
        blocks differ or carry activation hooks (then the step unrolls them).

        The stacking runs once, here, as one jitted program placing each stacked leaf on
        the mesh with its block sharding behind a replicated layer axis. It copies the
        blocks' weights; the model itself is left as it was.
        """
        if not scan_layers or not can_stack_layers(model):
            return nnx.split(model)
        graphdef, state = nnx.split(model)
        stacked_graphdef, abstract_state = nnx.split(nnx.eval_shape(
            lambda state: stack_layers(nnx.merge(graphdef, state)), state))
        if self.abstract:
            return stacked_graphdef, abstract_state  # placed by `_placed_abstract_state`
        shardings = None if self.mesh is None else parameter_shardings(
            abstract_state, self.mesh, self.layout)
        stacked_state = jax.jit(lambda state: nnx.state(stack_layers(nnx.merge(graphdef, state))),
                                out_shardings=shardings)(state)
        return stacked_graphdef, stacked_state

    def _allocate_pages(self) -> tuple[jax.Array, jax.Array | KiviPool | None]:
        """The zeroed stacked page pool `[L, P, Z, 2K, H]` (and 8-bit scales `[L, P, Z, 2K]`,
        or a KIVI pool's `KiviPool`), created directly on their shards."""
        config = self.config
        empty = PagedBatch(*(jnp.zeros((1,), jnp.int32) for _ in range(5)))  # [1] each

        def create() -> tuple[jax.Array, jax.Array | KiviPool | None]:
            cache = PagedKVCache.create(self.model_config, config.num_pages, config.page_size,
                                        empty, dtype=config.cache_dtype,
                                        num_residual=config.max_num_seqs)
            return cache.pages, cache.scales  # [L, P, Z, 2K, H], [L, P, Z, 2K]

        if self.mesh is None and not self.abstract:
            return create()
        shapes = jax.eval_shape(create)
        if self.mesh is None:
            return shapes
        with activate(self.mesh, self.layout):
            axis = active_axis("act_kv_heads")
        pool = NamedSharding(self.mesh, PartitionSpec(None, None, None, axis, None))
        # Each array beside the pages splits on its own head axis (`scale_spec`).
        shardings = (pool, jax.tree.map(lambda spec: NamedSharding(self.mesh, spec),
                                        scale_spec(shapes[1], axis),
                                        is_leaf=lambda spec: isinstance(spec, PartitionSpec)))
        if self.abstract:
            return jax.tree.map(
                lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                                             sharding=sharding),
                shapes, shardings)
        return jax.jit(create, out_shardings=shardings)()

    def _placed_abstract_state(self) -> nnx.State:
        """The abstract model's state with each leaf's sharding on the mesh (replicated
        leaves without a mesh), as `lower` needs its arguments."""
        if self.mesh is None:
            return self.state
        shardings = parameter_shardings(self.state, self.mesh, self.layout)
        return jax.tree.map(
            lambda value, sharding: jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                         sharding=sharding),
            self.state, shardings)

    # ------------------------------------------------------------------ device step

    def _device_step(self, state: nnx.State, pages: jax.Array,
                     scales: jax.Array | KiviPool | None,
                     inputs: StepInputs, *, with_prompt_logprobs: bool
                     ) -> tuple[jax.Array, jax.Array | KiviPool | None, StepOutputs]:
        model = nnx.merge(self.graphdef, state)
        last_token_index, sampling = inputs.last_token_index, inputs.sampling  # [Q]
        hidden, cache = model.hidden_states(
            inputs.token_ids[None], inputs.positions[None],
            PagedKVCache(pages, inputs.batch, scales))  # [1, T, D]
        prompt: dict[str, jax.Array] = {}
        if with_prompt_logprobs:
            all_logits = model.logits(hidden)[0]  # [T, V]
            logits = all_logits[last_token_index]  # [Q, V]
            prompt["prompt_logprobs"] = prompt_logprobs(all_logits,
                                                        inputs.next_token_ids)  # [T]
            ids, values = prompt_top_logprobs(all_logits, self.config.max_logprobs)  # [T, M]
            prompt["prompt_top_ids"], prompt["prompt_top_logprobs"] = ids, values
        else:
            last_hidden = hidden[0, last_token_index][None]  # [1, Q, D]
            logits = model.logits(last_hidden)[0]  # [Q, V]
        if self._replicated is not None:
            # The LM head leaves logits split over the vocabulary; gather them once here,
            # so sampling's sorts and top-k run on whole rows.
            logits = jax.lax.with_sharding_constraint(logits, self._replicated)  # [Q, V]
        # The key depends only on the request's seed and how many tokens it has sampled, so a
        # seeded request draws the same tokens whatever else is in the batch, and after a
        # preemption it redraws exactly what it drew before.
        keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed), index))(
            inputs.seeds, inputs.output_index)  # [Q]

        def with_top() -> tuple[jax.Array, ...]:
            return sample_tokens(logits, keys, sampling, self.config.max_logprobs)

        def without() -> tuple[jax.Array, ...]:
            return _without_top(sample_tokens(logits, keys, sampling, report_logprobs=False),
                                self.config.max_logprobs)

        # The log-softmax and top-M pass over [Q, V] run only in steps where some request
        # wants logprobs (the chosen token's logprob is reported only to those).
        tokens, chosen, top_ids, top_values = jax.lax.cond(
            jnp.any(inputs.want_logprobs), with_top, without)  # [Q], [Q], [Q, M], [Q, M]
        probabilities = None
        if self.config.return_probabilities:
            # Greedy drafts are verified by argmax alone, so an all-greedy batch skips the
            # [Q, V] sorts of top-k/top-p.
            probabilities = jax.lax.cond(
                jnp.all(greedy_rows(sampling)), lambda: jnp.zeros(logits.shape, jnp.float32),
                lambda: sampling_probabilities(logits, sampling))  # [Q, V]
        verification = None
        if self.config.num_speculative_tokens:
            verification = self._verify(model, hidden, last_token_index, sampling, keys,
                                        inputs.draft_token_ids, inputs.num_draft_tokens,
                                        inputs.draft_probs)
        outputs = StepOutputs(
            tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_values,
            probabilities=probabilities, **prompt,
            spec_tokens=None if verification is None else verification.token_ids,  # [Q, R + 1]
            num_accepted=None if verification is None else verification.num_accepted)  # [Q]
        return cache.pages, cache.scales, outputs

    def _verify(self, model: Transformer, hidden: jax.Array, last_token_index: jax.Array,
                sampling: SamplingArrays, keys: jax.Array, draft_token_ids: jax.Array,
                num_draft_tokens: jax.Array, draft_probs: jax.Array | None) -> Verification:
        """Scores each row's last known token and drafts, and verifies the drafts."""
        positions = self.config.num_speculative_tokens + 1
        num_seqs = last_token_index.shape[0]
        # Row s's drafts are its last num_draft_tokens fed tokens; position j of the window
        # predicts the token after draft j (j = 0: after the last known token). Positions past
        # a row's drafts repeat its last token, and verify ignores them.
        first = last_token_index - num_draft_tokens  # [Q]
        window = jnp.minimum(first[:, None] + jnp.arange(positions)[None, :],
                             last_token_index[:, None])  # [Q, R + 1]
        window = jnp.maximum(window, 0)  # [Q, R + 1]; padding rows point at token 0

        def scored() -> Verification:
            rows = hidden[0, window.reshape(-1)][None]  # [1, Q * (R + 1), D]
            logits = model.logits(rows)[0].reshape(num_seqs, positions, -1)  # [Q, R + 1, V]
            return verify(logits, draft_token_ids, draft_probs, num_draft_tokens, sampling,
                          keys)

        def nothing() -> Verification:
            return Verification(jnp.zeros((num_seqs, positions), jnp.int32),  # [Q, R + 1]
                                jnp.zeros((num_seqs,), jnp.int32))  # [Q]

        # Steps without drafts (prefills, non-speculating batches) skip the extra lm-head.
        return jax.lax.cond(jnp.any(num_draft_tokens > 0), scored, nothing)

    # ------------------------------------------------------------------ host side

    def prepare(self, sequences: Sequence[ScheduledRequest]) -> StepInputs:
        """Packs the scheduled requests into one step's inputs, padded to its buckets.

        Each request's `sampling_params` is None (greedy) or a
        `jaxinfer.engine.sampling_params.SamplingParams`; a request without a seed samples
        from a stream derived from its id.

        Raises:
            ValueError: No requests, more tokens or sequences than the largest bucket, a
                sequence that runs past its page table, more drafts than the runner
                verifies, or drafts without distributions where the runner wants them.
        """
        if not sequences:
            raise ValueError("a step needs at least one scheduled request")
        total = sum(len(sequence.token_ids) for sequence in sequences)
        for sequence in sequences:
            end = sequence.start_position + len(sequence.token_ids)
            if end > len(sequence.block_table) * self.config.page_size:
                raise ValueError(f"request {sequence.request_id!r}: {end} tokens do not fit "
                                 f"its {len(sequence.block_table)} pages")
        return self._pack(sequences, self.token_bucket(total))

    def token_bucket(self, num_tokens: int) -> int:
        """The padded token count T of a step feeding `num_tokens` tokens."""
        return bucket_for(num_tokens, self.config.token_buckets)

    def sequence_bucket(self, num_seqs: int) -> int:
        """The padded sequence count of a program over `num_seqs` sequences only (the draft
        model's decode loop; a step's Q follows from its token bucket)."""
        return bucket_for(num_seqs, self.config.sequence_buckets)

    def step_kind(self, sequences: Sequence[ScheduledRequest]) -> str:
        """Which program the step needs: `PROMPT_STEP` when a request wants the prompt
        logprobs this chunk predicts, else `STEP`.

        Raises:
            ValueError: Prompt logprobs are asked for while `enable_prompt_logprobs` is off.
        """
        wants_prompt = sorted(sequence.request_id for sequence in sequences
                              if _wants_prompt_logprobs(sequence))
        if wants_prompt and not self.config.enable_prompt_logprobs:
            raise ValueError(f"requests {wants_prompt} ask for prompt_logprobs, which this "
                             "runner was built without (enable_prompt_logprobs=False)")
        return PROMPT_STEP if wants_prompt else STEP

    def _pack(self, sequences: Sequence[ScheduledRequest], num_tokens: int) -> StepInputs:
        """`prepare` for a given token bucket (warm-up packs no sequences into each)."""
        config = self.config
        num_seqs = config.sequences_for(num_tokens)
        token_ids = np.zeros(num_tokens, np.int32)  # [T]
        positions = np.zeros(num_tokens, np.int32)  # [T]
        slots = np.full(num_tokens, -1, np.int32)  # [T]; -1: padding writes nothing
        next_token_ids = np.zeros(num_tokens, np.int32)  # [T]; for prompt logprobs
        kv_lens = np.zeros(num_seqs, np.int32)  # [Q]
        page_indices = np.zeros((num_seqs, config.pages_per_sequence),
                                np.int32)  # [Q, pages_per_sequence]
        cu_q_lens = np.zeros(num_seqs + 1, np.int32)  # [Q + 1]
        last = np.zeros(num_seqs, np.int32)  # [Q]
        seeds = np.zeros(num_seqs, np.uint32)  # [Q]
        output_index = np.zeros(num_seqs, np.int32)  # [Q]
        want_logprobs = np.zeros(num_seqs, np.bool_)  # [Q]
        num_drafts = config.num_speculative_tokens
        draft_token_ids = np.zeros((num_seqs, num_drafts), np.int32)  # [Q, R]
        num_draft_tokens = np.zeros(num_seqs, np.int32)  # [Q]
        # [Q, R, V], filled only when some request brings drafts (see `_draft_probs`).
        draft_probs = None
        offset = 0
        for s, sequence in enumerate(sequences):
            count = len(sequence.token_ids)
            table = np.asarray(sequence.block_table, np.int32)  # [len(table)]
            span = np.arange(sequence.start_position,
                             sequence.start_position + count)  # [count]
            token_ids[offset:offset + count] = sequence.token_ids
            positions[offset:offset + count] = span
            slots[offset:offset + count] = (table[span // config.page_size] * config.page_size
                                            + span % config.page_size)
            following = sequence.prompt_token_ids[sequence.start_position + 1:
                                                  sequence.start_position + 1 + count]
            next_token_ids[offset:offset + len(following)] = following
            kv_lens[s] = sequence.start_position + count
            page_indices[s, :len(table)] = table
            offset += count
            cu_q_lens[s + 1] = offset
            last[s] = offset - 1
            params = sequence.sampling_params
            # A request without a seed still gets its own stream, derived from its id.
            seed = params.seed if params is not None and params.seed is not None else (
                hash(sequence.request_id))
            seeds[s] = seed % (2 ** 32)
            output_index[s] = sequence.num_output_tokens
            want_logprobs[s] = params is not None and params.logprobs is not None
            drafts = sequence.spec_token_ids
            if drafts:
                if len(drafts) > num_drafts:
                    raise ValueError(f"request {sequence.request_id!r}: {len(drafts)} drafts, "
                                     f"the runner verifies at most {num_drafts}")
                draft_token_ids[s, :len(drafts)] = drafts
                num_draft_tokens[s] = len(drafts)
                if config.draft_distributions:
                    if sequence.spec_draft_probs is None:
                        raise ValueError(f"request {sequence.request_id!r}: drafts without "
                                         "the drafter's distributions")
                    if draft_probs is None:
                        draft_probs = np.zeros((num_seqs, num_drafts,
                                                self.model_config.vocab_size),
                                               np.float32)  # [Q, R, V]
                    draft_probs[s, :len(drafts)] = sequence.spec_draft_probs
        if config.draft_distributions and draft_probs is None:
            draft_probs = self._draft_probs_without_drafts(num_seqs)  # [Q, R, V] zeros
        cu_q_lens[len(sequences) + 1:] = offset
        residual_slots = None
        if self._kivi:
            residual_slots = np.zeros(num_seqs, np.int32)  # [Q]; padding rows read seat 0
            residual_slots[:len(sequences)] = [self._seat(sequence.request_id)
                                               for sequence in sequences]
        batch = PagedBatch(slots, kv_lens, page_indices, cu_q_lens,
                           np.asarray([len(sequences)], np.int32),  # num_seqs: [1]
                           residual_slots)
        sampling = build_sampling_arrays(
            [sequence.sampling_params for sequence in sequences], self.model_config.vocab_size,
            prompt_token_ids=[sequence.prompt_token_ids for sequence in sequences],
            output_token_ids=[sequence.output_token_ids for sequence in sequences],
            eos_token_ids=self.model_config.eos_token_ids, batch_size=num_seqs,
            allowed=self._allowed_bitmask(sequences, num_seqs))
        return StepInputs(token_ids, positions, batch, last, sampling, seeds, output_index,
                          want_logprobs, next_token_ids, draft_token_ids, num_draft_tokens,
                          draft_probs)

    def _seat(self, request_id: str) -> int:
        """A KIVI pool's residual seat of a request, given on its first step and kept until
        `release` (a preempted request keeps its seat: it restarts on a page boundary, so
        its seat's rows are rewritten before they are read)."""
        seat = self._seats.get(request_id)
        if seat is None:
            if not self._free_seats:
                raise RuntimeError(f"request {request_id!r}: all {self.config.max_num_seqs} "
                                   "KIVI residual seats are taken (a finished request was "
                                   "not released)")
            seat = self._seats[request_id] = self._free_seats.pop()
        return seat

    def release(self, request_ids: Sequence[str]) -> None:
        """Frees the residual seats of requests that finished or were aborted (a no-op for
        other pools and for requests without a seat)."""
        for request_id in request_ids:
            seat = self._seats.pop(request_id, None)
            if seat is not None:
                self._free_seats.append(seat)

    def _allowed_bitmask(self, sequences: Sequence[ScheduledRequest], num_seqs: int
                         ) -> np.ndarray | None:
        """`[Q, ceil(V / 32)]` the step's structured-output bitmasks: each constrained
        request that samples asks its grammar (`ScheduledRequest.grammar`) for the tokens it
        allows next; every other row allows all. None when no request is constrained."""
        constrained = [(s, sequence.grammar) for s, sequence in enumerate(sequences)
                       if sequence.grammar is not None and sequence.needs_sample]
        if not constrained:
            return None
        started = time.perf_counter()
        allowed = unconstrained_bitmask(num_seqs, self.model_config.vocab_size)  # [Q, W]
        for s, grammar in constrained:
            grammar.fill_bitmask(allowed[s])
        self.seconds["masks"] += time.perf_counter() - started
        return allowed

    def execute(self, sequences: Sequence[ScheduledRequest]) -> RunnerOutput:
        """Runs one step over the scheduled requests (see `prepare`).

        Returns:
            The sampled token of every request with `needs_sample` (the accepted drafts and
            one more token for a request with drafts) and, for requests with
            `prompt_logprobs`, the logprobs of the prompt tokens this step's chunk predicts.

        Raises:
            RequestsFailedError: Packing failed because of some requests alone (nothing ran, and
                nothing was sent to the followers): the caller drops them and runs the rest.
            ValueError: As `prepare` and `step_kind`, when no request alone is at fault.
        """
        if not sequences:
            return RunnerOutput({}, {})
        started = time.perf_counter()
        try:
            kind = self.step_kind(sequences)
            inputs = self.prepare(sequences)
        except Exception as error:
            failing = self._failing_requests(sequences)
            if not failing:
                raise  # not one request's fault: the engine's own bug
            raise RequestsFailedError(failing) from error
        prepared = time.perf_counter()
        result: StepOutputs = jax.device_get(self._launch(kind, inputs))
        self.seconds["prepare"] += prepared - started
        self.seconds["device"] += time.perf_counter() - prepared
        sampled, prompt, speculated = {}, {}, {}
        offset = 0
        for s, sequence in enumerate(sequences):
            if sequence.spec_token_ids:
                emitted = int(result.num_accepted[s]) + 1
                speculated[sequence.request_id] = result.spec_tokens[s, :emitted].tolist()
            elif sequence.needs_sample:
                sampled[sequence.request_id] = SampledToken(
                    int(result.tokens[s]), float(result.logprobs[s]), result.top_ids[s],
                    result.top_logprobs[s],
                    None if result.probabilities is None else result.probabilities[s])
            if kind == PROMPT_STEP and _wants_prompt_logprobs(sequence):
                start = sequence.start_position
                # Fed position i predicts prompt token i + 1, which must exist.
                count = min(len(sequence.token_ids),
                            len(sequence.prompt_token_ids) - 1 - start)
                rows = slice(offset, offset + count)
                prompt[sequence.request_id] = PromptLogprobs(
                    start + 1, result.prompt_logprobs[rows], result.prompt_top_ids[rows],
                    result.prompt_top_logprobs[rows])
            offset += len(sequence.token_ids)
        return RunnerOutput(sampled, prompt, speculated)

    def _failing_requests(self, sequences: Sequence[ScheduledRequest]
                          ) -> dict[str, Exception]:
        """The requests that fail to pack even alone, with their errors (after packing the
        whole step failed: this is the slow path, one small packing per request)."""
        failing = {}
        for sequence in sequences:
            try:
                self.step_kind([sequence])
                self.prepare([sequence])
            except Exception as error:  # whatever it raised is its failure
                failing[sequence.request_id] = error
        return failing

    def _draft_probs_without_drafts(self, num_seqs: int) -> np.ndarray | jax.Array:
        """The `[Q, R, V]` zeros a step without drafts passes for the drafter's distributions,
        made once per Q: allocating and sending them every step cost a speculating engine
        3-9% of a small model's step even while it did not speculate. On one device they stay
        on it; a mesh or a multi-host leader gets the (read-only) host array."""
        cached = self._no_draft_probs.get(num_seqs)
        if cached is None:
            zeros = np.zeros((num_seqs, self.config.num_speculative_tokens,
                              self.model_config.vocab_size), np.float32)  # [Q, R, V]
            zeros.setflags(write=False)
            single = self._replicated is None and self._channel is None
            cached = self._no_draft_probs[num_seqs] = jax.device_put(zeros) if single else zeros
        return cached

    def _launch(self, kind: str, inputs: StepInputs) -> StepOutputs:
        """Sends the step to the followers (a multi-host leader), then runs it here."""
        if self._channel is not None:
            self._channel.send(kind, (self._channel_tag, inputs))
        return self.run(kind, inputs)

    def run(self, kind: str, inputs: StepInputs) -> StepOutputs:
        """Runs the jitted step `kind` (`STEP` or `PROMPT_STEP`) on host inputs from some
        process's `prepare`; updates the page pool and returns the (device) results.

        This process only: a multi-host follower calls it with what the leader sent. On a
        mesh the inputs become replicated global arrays (each process gives the whole value,
        as `make_array_from_process_local_data` expects of a replicated array), and the step
        runs under the mesh and layout, which are part of what it was compiled for.

        Raises:
            ValueError: An unknown step kind.
        """
        if kind not in self._steps:
            raise ValueError(f"unknown step kind {kind!r}; known: {list(STEP_KINDS)}")
        program = self._program(kind, inputs.token_ids.shape[0])
        if self._replicated is not None:
            inputs = jax.tree.map(
                lambda x: jax.make_array_from_process_local_data(self._replicated, x), inputs)
        with activate(self.mesh, self.layout):
            self.pages, self.scales, result = program(self.state, self.pages, self.scales,
                                                      inputs)
        return result

    def _program(self, kind: str, num_tokens: int) -> jax.stages.Compiled:
        """The compiled step `kind` for token bucket `num_tokens`, compiled now if it is not
        yet (the persistent compilation cache may hold it)."""
        program = self._programs.get((kind, num_tokens))
        if program is None:
            program = self._programs[(kind, num_tokens)] = self.lower(kind, num_tokens).compile()
        return program

    def lower(self, kind: str, num_tokens: int) -> jax.stages.Lowered:
        """Lowers the step `kind` for token bucket T = `num_tokens` (and its Q) without running
        it; `.compile()` it for the compiled program, its memory and cost analyses and its HLO.

        Works on an `abstract` runner too: then the mesh's devices need not be attached
        (a TPU topology described on a CPU machine), and the Pallas kernels lower for the
        mesh's TPU because the mesh is set while lowering.

        Raises:
            ValueError: An unknown step kind, or a bucket this runner does not compile.
        """
        if kind not in self._steps:
            raise ValueError(f"unknown step kind {kind!r}; known: {list(STEP_KINDS)}")
        if num_tokens not in self.config.token_buckets:
            raise ValueError(f"{num_tokens} is not a token bucket: "
                             f"{self.config.token_buckets}")
        inputs = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated),
            self._pack([], num_tokens))
        with activate(self.mesh, self.layout):
            return self._steps[kind].lower(self.state, self.pages, self.scales, inputs)

    def run_on_cache(self, program: Callable[..., tuple[Any, Any, Any]], *args: Any) -> Any:
        """Runs another program over this runner's model and page pool; returns its result.

        For a proposer whose loop over the cache is not a step (the draft model's decode
        loop): `program(state, pages, scales, *args)` must return `(pages, scales,
        result)`, the pool updated (donate it); `merge` rebuilds the model from `state`
        inside it. The program runs under the runner's mesh and layout.
        """
        with activate(self.mesh, self.layout):
            self.pages, self.scales, result = program(self.state, self.pages, self.scales,
                                                      *args)
        return result

    def merge(self, state: nnx.State) -> Transformer:
        """The model with `state` (inside a program given to `run_on_cache`)."""
        return nnx.merge(self.graphdef, state)

    def warm_up(self, kinds: Sequence[str] = (STEP,)) -> float:
        """Compiles the steps `kinds` for every token bucket; returns seconds.

        Tracing and lowering hold the GIL, so they run one after another on this thread;
        each program's compile starts as soon as it is lowered, on a pool of one thread per
        core (XLA releases the GIL), so compiles overlap each other and the next lowering.
        A multi-host leader then runs each program once on padding (which writes nothing and
        reads only the null page), so that the followers, which receive it, compile theirs.
        """
        started = time.perf_counter()
        wanted = [(kind, num_tokens) for kind in kinds for num_tokens in self.config.token_buckets
                  if (kind, num_tokens) not in self._programs]
        workers = max(1, min(len(wanted), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            # Largest first: the longest compiles start earliest.
            compiled = {key: pool.submit(self.lower(*key).compile)
                        for key in sorted(wanted, key=lambda key: -key[1])}
            for key, future in compiled.items():
                self._programs[key] = future.result()
        if self._channel is not None:
            for kind, num_tokens in wanted:
                jax.block_until_ready(self._launch(kind, self._pack([], num_tokens)))
        self.warm_up_seconds = time.perf_counter() - started
        return self.warm_up_seconds

    def time_steps(self, repeats: int = 3) -> dict[tuple[int, bool], float]:
        """Times the compiled plain step of every token bucket on padding (it writes
        nothing), packing included, the fastest of `repeats` runs; with drafts enabled, also
        each bucket with its verification running (one padding row claims a draft).

        Call after `warm_up`; it compiles nothing. A multi-host leader's followers run the
        same steps.

        Returns:
            Seconds per (token bucket, verifies drafts), a cost model's starting point.
        """
        timings = {}
        variants = (False, True) if self.config.num_speculative_tokens else (False,)
        for num_tokens in self.config.token_buckets:
            for verifies in variants:
                best = float("inf")
                for _ in range(repeats):
                    started = time.perf_counter()
                    inputs = self._pack([], num_tokens)
                    if verifies:
                        claimed = np.zeros_like(inputs.num_draft_tokens)  # [Q]
                        claimed[0] = 1
                        inputs = inputs._replace(num_draft_tokens=claimed)
                    jax.device_get(self._launch(STEP, inputs))
                    best = min(best, time.perf_counter() - started)
                timings[(num_tokens, verifies)] = best
        return timings

    @property
    def compilations(self) -> int:
        """Step programs compiled so far (constant after `warm_up`, unless a request asks
        for prompt logprobs in a bucket that has not had them yet)."""
        return len(self._programs)


def _wants_prompt_logprobs(sequence: ScheduledRequest) -> bool:
    """Whether the request asked for prompt logprobs and this chunk predicts prompt tokens."""
    params = sequence.sampling_params
    return (params is not None and params.prompt_logprobs is not None
            and sequence.start_position + 1 < len(sequence.prompt_token_ids))


def _without_top(sampled: tuple[jax.Array, ...], num_logprobs: int) -> tuple[jax.Array, ...]:
    """`sample_tokens(..., report_logprobs=False)`'s result with zero-filled `[Q, M]`
    top-logprob arrays, so both branches of the step's `lax.cond` have the same shapes."""
    tokens, chosen, _, _ = sampled
    rows = tokens.shape[0]
    return (tokens, chosen, jnp.zeros((rows, num_logprobs), jnp.int32),  # [Q], [Q], [Q, M]
            jnp.zeros((rows, num_logprobs), jnp.float32))  # [Q, M]
