"""The device side of the engine: one jitted step over a padded, bucketed ragged batch.

Each step receives, from the scheduler, the new tokens of every scheduled request (a prefill
chunk or one decode token), where they sit (start position, block table) and whether a token
must be sampled after them (`jaxinfer.engine.scheduler.ScheduledRequest`). The runner packs
them into one `[1, T]` row (T rounded up to a token bucket, S requests rounded up to a
sequence bucket, every block table padded to `pages_per_sequence` with the null page 0),
runs the model over the paged cache (donated, so it is updated in place), and samples one
token per request from the logits of its last token, on device, with per-request
parameters and per-request PRNG keys.

Shapes depend only on the two bucket sizes, so `warm_up` compiles every (T, S) pair once and
the engine never compiles again; `compilations` counts the cache entries to prove it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.engine.scheduler import ScheduledRequest
from jaxinfer.models import PagedBatch, PagedKVCache, Transformer
from jaxinfer.sampling import sample


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """`smallest, 2 * smallest, ...` up to and including `largest`."""
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    buckets.append(largest)
    return tuple(buckets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """Static sizes of the device step.

    Attributes:
        num_pages: Pages in the pool (page 0 is the null page padding rows point to).
        page_size: Tokens per page.
        max_num_batched_tokens: The largest token bucket (the scheduler's token budget).
        max_num_seqs: The largest sequence bucket.
        max_model_len: Longest sequence; fixes the page-table width.
        cache_dtype: KV page dtype (default: the model's compute dtype).
        min_token_bucket: The smallest token bucket.
    """

    num_pages: int
    page_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    cache_dtype: str | None = None
    min_token_bucket: int = 8

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len", "min_token_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.num_pages < 2:
            raise ValueError(f"num_pages = {self.num_pages}: page 0 is reserved, need >= 2")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_seqs = {self.max_num_seqs} exceeds "
                             f"max_num_batched_tokens = {self.max_num_batched_tokens}: every "
                             "scheduled sequence brings at least one token")

    @property
    def pages_per_sequence(self) -> int:
        """Page-table width: enough pages for `max_model_len` tokens."""
        return -(-self.max_model_len // self.page_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Padded token counts the step is compiled for."""
        return power_of_two_buckets(min(self.min_token_bucket, self.max_num_batched_tokens),
                                    self.max_num_batched_tokens)

    @property
    def sequence_buckets(self) -> tuple[int, ...]:
        """Padded sequence counts the step is compiled for."""
        return power_of_two_buckets(1, self.max_num_seqs)


@dataclasses.dataclass(frozen=True)
class SequenceSampling:
    """Per-sequence sampling parameters as the device step takes them (None means greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def _bucket(size: int, buckets: Sequence[int]) -> int:
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")


class ModelRunner:
    """Owns the model, the page pool and the compiled step."""

    def __init__(self, model: Transformer, config: RunnerConfig) -> None:
        self.config = config
        self.model_config = model.config
        self.graphdef, self.state = nnx.split(model)
        empty = PagedBatch(*(jnp.zeros((1,), jnp.int32) for _ in range(5)))
        cache = PagedKVCache.create(model.config, config.num_pages, config.page_size, empty,
                                    dtype=config.cache_dtype)
        self.pages = cache.layers
        self._step = jax.jit(self._device_step, donate_argnums=(1,))
        self.warm_up_seconds: float | None = None

    # ------------------------------------------------------------------ device step

    def _device_step(self, state: nnx.State, pages: tuple[jax.Array, ...],
                     token_ids: jax.Array, positions: jax.Array, batch: PagedBatch,
                     last_token_index: jax.Array, sampling: dict[str, jax.Array]
                     ) -> tuple[tuple[jax.Array, ...], jax.Array]:
        model = nnx.merge(self.graphdef, state)
        hidden, cache = model.hidden_states(token_ids[None], positions[None],
                                            PagedKVCache(pages, batch))  # [1, T, D]
        last_hidden = hidden[0, last_token_index][None]  # [1, S, D]
        logits = model.logits(last_hidden)[0]  # [S, V]
        keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed), index))(
            sampling["seed"], sampling["output_index"])  # [S]
        tokens = sample(logits, keys, sampling["temperature"], sampling["top_k"],
                        sampling["top_p"])  # [S]
        return cache.layers, tokens

    # ------------------------------------------------------------------ host side

    def _pack(self, sequences: Sequence[ScheduledRequest], num_tokens: int,
              num_seqs: int) -> tuple:
        config = self.config
        token_ids = np.zeros(num_tokens, np.int32)  # [T]
        positions = np.zeros(num_tokens, np.int32)  # [T]
        slots = np.full(num_tokens, -1, np.int32)  # [T]; -1: padding writes nothing
        kv_lens = np.zeros(num_seqs, np.int32)  # [S]
        page_indices = np.zeros((num_seqs, config.pages_per_sequence), np.int32)  # [S, P/S]
        cu_q_lens = np.zeros(num_seqs + 1, np.int32)  # [S + 1]
        last = np.zeros(num_seqs, np.int32)  # [S]
        sampling = {"temperature": np.zeros(num_seqs, np.float32),
                    "top_k": np.zeros(num_seqs, np.int32),
                    "top_p": np.ones(num_seqs, np.float32),
                    "seed": np.zeros(num_seqs, np.uint32),
                    "output_index": np.zeros(num_seqs, np.int32)}
        offset = 0
        for s, sequence in enumerate(sequences):
            count = len(sequence.token_ids)
            table = np.asarray(sequence.block_table, np.int32)
            span = np.arange(sequence.start_position, sequence.start_position + count)
            token_ids[offset:offset + count] = sequence.token_ids
            positions[offset:offset + count] = span
            slots[offset:offset + count] = (table[span // config.page_size] * config.page_size
                                            + span % config.page_size)
            kv_lens[s] = sequence.start_position + count
            page_indices[s, :len(table)] = table
            offset += count
            cu_q_lens[s + 1] = offset
            last[s] = offset - 1
            params = sequence.sampling_params or SequenceSampling()
            sampling["temperature"][s] = params.temperature
            sampling["top_k"][s] = params.top_k
            sampling["top_p"][s] = params.top_p
            # A request without a seed still gets its own stream, derived from its id.
            seed = params.seed if params.seed is not None else hash(sequence.request_id)
            sampling["seed"][s] = seed % (2 ** 32)
            sampling["output_index"][s] = sequence.num_output_tokens
        cu_q_lens[len(sequences) + 1:] = offset
        batch = PagedBatch(slots, kv_lens, page_indices, cu_q_lens,
                           np.asarray([len(sequences)], np.int32))
        return token_ids, positions, batch, last, sampling

    def execute(self, sequences: Sequence[ScheduledRequest]) -> dict[str, int]:
        """Runs one step; returns the sampled token of every request with `needs_sample`.

        Each request's `sampling_params` is None (greedy) or has `temperature`, `top_k`,
        `top_p` and `seed` (None: a stream derived from the request id) attributes.

        Raises:
            ValueError: The step has more tokens or sequences than the largest bucket, or a
                sequence runs past its page table.
        """
        if not sequences:
            return {}
        total = sum(len(sequence.token_ids) for sequence in sequences)
        num_tokens = _bucket(total, self.config.token_buckets)
        num_seqs = _bucket(len(sequences), self.config.sequence_buckets)
        for sequence in sequences:
            end = sequence.start_position + len(sequence.token_ids)
            if end > len(sequence.block_table) * self.config.page_size:
                raise ValueError(f"request {sequence.request_id!r}: {end} tokens do not fit "
                                 f"its {len(sequence.block_table)} pages")
        token_ids, positions, batch, last, sampling = self._pack(sequences, num_tokens,
                                                                 num_seqs)
        self.pages, tokens = self._step(self.state, self.pages, token_ids, positions, batch,
                                        last, sampling)
        tokens = np.asarray(tokens)
        return {sequence.request_id: int(tokens[s]) for s, sequence in enumerate(sequences)
                if sequence.needs_sample}

    def warm_up(self) -> float:
        """Compiles the step for every (token bucket, sequence bucket) pair; returns seconds.

        Padding-only steps write nothing (every slot is -1) and read only the null page.
        """
        started = time.perf_counter()
        for num_tokens in self.config.token_buckets:
            for num_seqs in self.config.sequence_buckets:
                if num_seqs > num_tokens:
                    continue  # a step never has more sequences than tokens
                token_ids, positions, batch, last, sampling = self._pack([], num_tokens,
                                                                         num_seqs)
                self.pages, tokens = self._step(self.state, self.pages, token_ids, positions,
                                                batch, last, sampling)
        jax.block_until_ready(tokens)
        self.warm_up_seconds = time.perf_counter() - started
        return self.warm_up_seconds

    @property
    def compilations(self) -> int:
        """Programs compiled for the step so far (constant after `warm_up`)."""
        return self._step._cache_size()
