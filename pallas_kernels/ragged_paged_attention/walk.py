"""The online-softmax walk that both Pallas attention kernels share.

`kernel.py` (float and int8 pages) and `kivi_kernel.py` (KIVI int4 / int2 codes) differ only
in what a block of pages copies and how its keys and values come out of VMEM. Everything
else is here, written once: which blocks of a sequence's pages a tile of query rows needs,
which (row, key) pairs it may see (causal by position, its own sequence's rows, the optional
sliding window), and the update of one head's running max, denominator and weighted sum
with one block of keys (scores optionally soft-capped, `cap * tanh(s / cap)`).

Shape letters: rows = a tile's query rows (block_tokens * G), S = keys in one block of pages
(pages_per_block * Z), H = head dim; the scratch refs are `[heads, rows, 1]` (max and
denominator) and `[heads, rows, H]` (accumulator), f32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASKED = -1e30  # finite: a row that sees nothing keeps exp(...) == 0 instead of NaN


def start_accumulators(running_max: Any, denominator: Any, accumulator: Any) -> None:
    """Resets a program's softmax scratch before its walk."""
    running_max[...] = jnp.full(running_max.shape, MASKED, jnp.float32)
    denominator[...] = jnp.zeros(denominator.shape, jnp.float32)
    accumulator[...] = jnp.zeros(accumulator.shape, jnp.float32)


def key_block_range(kv_len: jax.Array, query_start: jax.Array, query_end: jax.Array,
                    tile_start: int | jax.Array, tile_end: int | jax.Array, block_keys: int,
                    sliding_window: int | None) -> tuple[jax.Array, jax.Array]:
    """`(first_block, end_block)`: the blocks of a sequence's pages that the tile's tokens of
    the sequence can see, from the window's start of its first token to its last token."""
    last_token = jnp.minimum(query_end, tile_end) - 1
    first_token = jnp.maximum(query_start, tile_start)
    last_position = kv_len - (query_end - last_token)
    first_key = 0
    if sliding_window is not None:
        first_position = kv_len - (query_end - first_token)
        first_key = jnp.maximum(first_position - sliding_window + 1, 0)
    return first_key // block_keys, last_position // block_keys + 1


def visible_keys(block: jax.Array, block_keys: int, kv_len: jax.Array,
                 query_start: jax.Array, query_end: jax.Array, row_token: jax.Array,
                 sliding_window: int | None) -> jax.Array:
    """`[rows, S]` which keys of `block` each query row may attend to.

    Args:
        row_token: `[rows, 1]` the packed token index of each query row.
    """
    key_position = block * block_keys + jax.lax.broadcasted_iota(
        jnp.int32, (1, block_keys), 1)  # [1, S]
    row_position = kv_len - (query_end - row_token)  # [rows, 1]
    visible = ((row_token >= query_start) & (row_token < query_end)
               & (key_position <= row_position) & (key_position < kv_len))  # [rows, S]
    if sliding_window is not None:
        visible &= row_position - key_position < sliding_window
    return visible


def fold_block(head: int, query: jax.Array, keys: jax.Array, values: jax.Array,
               visible: jax.Array, running_max: Any, denominator: Any, accumulator: Any,
               soft_cap: float | None) -> None:
    """Folds one block of keys into head `head`'s online softmax.

    Args:
        query: `[rows, H]` f32, already scaled by sm_scale.
        keys, values: `[S, H]` f32.
        visible: `[rows, S]` from `visible_keys`.
    """
    scores = jax.lax.dot_general(query, keys, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [rows, S]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible, scores, MASKED)  # [rows, S]
    previous_max = running_max[head]  # [rows, 1]
    new_max = jnp.maximum(previous_max, jnp.max(scores, axis=1, keepdims=True))  # [rows, 1]
    rescale = jnp.exp(previous_max - new_max)  # [rows, 1]
    probabilities = jnp.where(visible, jnp.exp(scores - new_max), 0.0)  # [rows, S]
    denominator[head] = denominator[head] * rescale + jnp.sum(probabilities, axis=1,
                                                              keepdims=True)
    accumulator[head] = accumulator[head] * rescale + jax.lax.dot_general(
        probabilities, values, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)  # [rows, H]
    running_max[head] = new_max


def write_output(out_ref: Any, denominator: Any, accumulator: Any) -> None:
    """The normalised weighted sums; rows that saw no key (padding) stay zero."""
    total = denominator[...]  # [heads, rows, 1]
    out_ref[...] = (accumulator[...] / jnp.where(total > 0, total, 1.0)).astype(out_ref.dtype)


def walk_pages(first_block: jax.Array, end_block: jax.Array,
               copies: Callable[[jax.Array, jax.Array], list[Any]],
               attend: Callable[[jax.Array, jax.Array], None]) -> None:
    """Blocks `first_block` .. `end_block - 1` of a sequence's pages, double-buffered: block
    j + 1's asynchronous copies are in flight while block j is computed.

    Args:
        copies: `(block, slot)` -> the block's HBM -> VMEM copies into buffer slot `slot`
            (0 or 1); called again to wait on the same copies.
        attend: `(block, slot)` computes with the block once its copies have landed.
    """
    for copy in copies(first_block, first_block % 2):
        copy.start()

    def block_body(block: jax.Array, carry: int) -> int:
        slot = block % 2

        @pl.when(block + 1 < end_block)
        def _prefetch_next():
            for copy in copies(block + 1, (block + 1) % 2):
                copy.start()

        for copy in copies(block, slot):
            copy.wait()
        attend(block, slot)
        return carry

    jax.lax.fori_loop(first_block, end_block, block_body, 0)


def regroup_queries(queries: jax.Array, num_kv_heads: int, block_tokens: int) -> jax.Array:
    """`[T, N, H]` -> `[K, T' * G, H]`: row `t * G + g` of KV head k is query head
    `k * G + g` of token t; T' pads T to whole tiles of `block_tokens`.

    Raises:
        ValueError: N is not a multiple of K.
    """
    num_tokens, num_heads, head_dim = queries.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    padded_tokens = -(-num_tokens // block_tokens) * block_tokens
    # The barrier keeps the regrouping below on the (small) queries: without it the TPU
    # compiler moved the transpose into the layout of the projection that made them, and
    # copied the whole q_proj weight into that layout every step (found compiling
    # Llama-3-8B's step for v5e: 4 MiB per layer and chip).
    queries = jax.lax.optimization_barrier(queries)  # [T, N, H]
    regrouped = queries.reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, K, G, H]
    regrouped = jnp.pad(regrouped, ((0, padded_tokens - num_tokens), (0, 0), (0, 0), (0, 0)))
    return regrouped.transpose(1, 0, 2, 3).reshape(
        num_kv_heads, padded_tokens * group, head_dim)  # [K, T' * G, H]


def ungroup_output(out: jax.Array, num_tokens: int, num_heads: int) -> jax.Array:
    """`[K, T' * G, H]` -> `[T, N, H]`, the inverse of `regroup_queries`."""
    num_kv_heads, _, head_dim = out.shape
    group = num_heads // num_kv_heads
    out = out.reshape(num_kv_heads, -1, group, head_dim).transpose(1, 0, 2, 3)  # [T', K, G, H]
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim)  # [T, N, H]
