"""Perplexity of a model on a token stream, with a sliding window (`jaxinfer eval ppl`).

The stream is cut into windows of `window` input tokens starting every `stride` tokens
(stride = window: disjoint windows; smaller: overlapping ones, so later tokens see more
context). Each token from the second on is scored exactly once, in the first window that
predicts it after the tokens the previous window already scored, from the tokens before it in
that window (transformers' sliding-window recipe, without its loss of each window's first
token). PPL = exp(mean negative log-likelihood).

    result = perplexity(model, token_ids, window=256, stride=128)
    result.ppl, result.tokens

With `kv_cache_dtype`, each window goes through the engine's path instead: its keys and
values are written to a paged KV cache of that dtype and attention reads them back from the
pages (`PagedKVCache`, `ragged_paged_attention`), so the cache's precision (e.g. int8) is
what the score sees. Without it the model runs with no cache (keys at compute precision).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models import PagedBatch, PagedKVCache, Transformer

PAGE_SIZE = 16  # tokens per page of the paged path


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """`ppl` = exp(`nll` / `tokens`): the scored tokens and their summed NLL (nats)."""

    ppl: float
    tokens: int
    nll: float


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """`(begin, end, score_from)` per window: it feeds the `end - 1 - begin <= window` tokens
    [begin, end - 1) and scores the tokens with index in [score_from, end), each predicted
    from the tokens before it in the window.

    Consecutive windows start `stride` tokens apart; every token from index 1 on is scored
    exactly once (stride = window: disjoint windows, each token predicted from the ones
    before it in its own window).

    Raises:
        ValueError: window < 1, or stride outside [1, window] (tokens would go unscored).
    """
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"window = {window}, stride = {stride}: need window >= 1 and "
                         "1 <= stride <= window")
    windows, scored_until, begin = [], 1, 0
    while scored_until < num_tokens:
        end = min(begin + window + 1, num_tokens)
        windows.append((begin, end, scored_until))
        scored_until = end
        begin += stride
    return windows


def paged_logits(model: Transformer, inputs: jax.Array, kv_cache_dtype: str) -> jax.Array:
    """`[B, T, V]` logits of `[B, T]` windows run as one ragged prefill of B sequences over a
    fresh paged cache of `kv_cache_dtype` (page 0 is the null page, as in the engine)."""
    rows, length = inputs.shape
    pages_per_row = -(-length // PAGE_SIZE)
    offsets = jnp.arange(length, dtype=jnp.int32)  # [T]
    first_page = 1 + pages_per_row * jnp.arange(rows, dtype=jnp.int32)  # [B]
    page_indices = first_page[:, None] + jnp.arange(pages_per_row, dtype=jnp.int32)  # [B, P/B]
    slots = ((first_page[:, None] + offsets[None, :] // PAGE_SIZE) * PAGE_SIZE
             + offsets[None, :] % PAGE_SIZE)  # [B, T]
    batch = PagedBatch(
        slot_mapping=slots.reshape(-1),  # [B * T]
        kv_lens=jnp.full((rows,), length, jnp.int32),  # [B]
        page_indices=page_indices,
        cu_q_lens=length * jnp.arange(rows + 1, dtype=jnp.int32),  # [B + 1]
        num_seqs=jnp.asarray([rows], jnp.int32),
        residual_slots=jnp.arange(rows, dtype=jnp.int32))  # [B]; used by KIVI pools only
    cache = PagedKVCache.create(model.config, 1 + rows * pages_per_row, PAGE_SIZE, batch,
                                dtype=kv_cache_dtype, num_residual=rows)
    positions = jnp.tile(offsets, rows)[None]  # [1, B * T]
    hidden, _ = model.hidden_states(inputs.reshape(1, -1), positions, cache)  # [1, B*T, D]
    return model.logits(hidden).reshape(rows, length, -1)  # [B, T, V]


def perplexity(model: Transformer, token_ids: Sequence[int] | np.ndarray, *, window: int = 256,
               stride: int | None = None, batch_size: int = 8,
               kv_cache_dtype: str | None = None) -> PerplexityResult:
    """Sliding-window perplexity of `model` on one token stream.

    Args:
        model: Any model (float or quantized); run without a KV cache.
        token_ids: The stream, e.g. the tokenizer's encoding of a text (BOS first).
        window: Tokens per forward pass.
        stride: Tokens between window starts; default `window` (disjoint windows).
        batch_size: Windows per forward pass (all padded to `window`: one compilation).
        kv_cache_dtype: None runs without a cache; a dtype ("float32", "bfloat16", "int8",
            "fp8_e4m3", "fp8_e5m2", KIVI's "int4" / "int2") runs every window through a paged
            KV cache of that dtype (one prefill per window: KIVI's residual is the window's
            partial last page).

    Returns:
        The perplexity, the number of scored tokens and their total NLL.

    Raises:
        ValueError: Fewer than two tokens, or a bad window/stride.
    """
    ids = np.asarray(token_ids, np.int32)  # [len(token_ids)]
    if ids.size < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {ids.size}")
    spans = sliding_windows(ids.size, window, stride or window)
    inputs = np.zeros((len(spans), window), np.int32)  # [W, T]
    targets = np.zeros((len(spans), window), np.int32)  # [W, T]; position j predicts j + 1
    weights = np.zeros((len(spans), window), np.float32)  # [W, T]; 1 where scored
    for row, (begin, end, score_from) in enumerate(spans):
        inputs[row, :end - 1 - begin] = ids[begin:end - 1]
        targets[row, :end - 1 - begin] = ids[begin + 1:end]
        # Position j predicts token begin + j + 1, scored when it lies in [score_from, end);
        # score_from >= begin + 1 because stride <= window.
        weights[row, score_from - begin - 1:end - 1 - begin] = 1.0
    padding = -len(spans) % batch_size
    inputs, targets, weights = (np.pad(array, ((0, padding), (0, 0)))
                                for array in (inputs, targets, weights))
    graphdef, state = nnx.split(model)

    @jax.jit
    def batch_nll(state: nnx.State, inputs: jax.Array, targets: jax.Array,
                  weights: jax.Array) -> jax.Array:
        # Right padding needs no mask: no real token attends to a later position.
        model = nnx.merge(graphdef, state)
        if kv_cache_dtype is None:
            logits, _ = model(inputs)  # [B, T, V]
        else:
            logits = paged_logits(model, inputs, kv_cache_dtype)  # [B, T, V]
        log_probs = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V]
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, T]
        return -jnp.sum(picked * weights)

    total = 0.0
    for start in range(0, inputs.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        total += float(batch_nll(state, inputs[rows], targets[rows], weights[rows]))
    count = int(weights.sum())
    return PerplexityResult(math.exp(total / count), count, total)
