"""Grouped-query self-attention over a contiguous KV cache (or over the current tokens only).

Masking is by position, never by padding flags: a query at position p sees keys at positions
q <= p, and with a sliding window only those with p - q < sliding_window (that many keys, itself
included, as in transformers' Mistral). Right-padded batches therefore need no extra mask:
padding sits after every real token, so no real query ever sees it, and pad slots in the cache
are overwritten by the next decoded token before anyone can attend to them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.models.hooks import ActivationHooks, cached_keys_values, linear_input
from jaxinfer.models.layers import dtype_of, make_linear, make_param, project_together
from jaxinfer.models.rope import apply_rope, inverse_frequencies
from jaxinfer.sharding import active_axis, constrain
from pallas_kernels.ragged_paged_attention import (
    KiviPool,
    ragged_paged_attention,
    write_to_kivi_pages,
    write_to_pages,
    write_to_quantized_pages,
)

_MASKED = -1e30  # Large negative rather than -inf so fully masked rows stay finite.


class LayerCache(NamedTuple):
    """The contiguous cache of one layer: slot s of row b holds position s of sequence b."""

    keys: jax.Array  # [B, S, K, H]
    values: jax.Array  # [B, S, K, H]


class PagedBatch(NamedTuple):
    """Where a ragged batch's tokens live in the page pool (all int32; see
    `pallas_kernels.ragged_paged_attention.reference` for the layout)."""

    slot_mapping: jax.Array  # [T] flat page slot each new token's key and value go to; -1: pad
    kv_lens: jax.Array  # [Q] keys per sequence after this step
    page_indices: jax.Array  # [Q, pages_per_seq] page table per sequence
    cu_q_lens: jax.Array  # [Q + 1] query token offsets of each sequence
    num_seqs: jax.Array  # [1] real sequences
    # [Q] each sequence's seat in a KIVI pool's residual pool (its partial last page's exact
    # rows); None for other pools.
    residual_slots: jax.Array | None = None


class PagedLayerCache(NamedTuple):
    """The stacked pool, the layer whose pages this block reads and writes, and the batch.

    The block indexes `pages[layer]` inside the attention ops (`layer=`), so neither a loop
    nor a scan over layers copies a layer's pages out of the pool.
    """

    pages: jax.Array  # [L, P, Z, 2K, H]
    batch: PagedBatch
    # [L, P, Z, 2K] of an 8-bit pool, or a KIVI pool's `KiviPool` (one pytree)
    scales: jax.Array | KiviPool | None = None
    layer: jax.Array | int = 0  # int32 scalar (a scan's index) or a Python int


def dot_product_attention(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    query_positions: jax.Array,
    key_positions: jax.Array,
    sliding_window: int | None,
) -> jax.Array:
    """Causal grouped-query attention, softmax in float32.

    Args:
        queries: `[B, T, N, H]`.
        keys: `[B, S, K, H]`, K dividing N.
        values: `[B, S, K, H]`.
        query_positions: `[B, T]` int32 positions of the queries.
        key_positions: `[B, S]` int32 positions of the keys; negative marks an empty slot.
        sliding_window: Keys visible per query (itself included), or None for all.

    Returns:
        `[B, T, N, H]` attention outputs in the queries' dtype.
    """
    batch, num_queries, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    grouped = queries.reshape(batch, num_queries, num_kv_heads, group, head_dim)  # [B,T,K,G,H]
    scores = jnp.einsum("btkgh,bskh->bkgts", grouped, keys,
                        preferred_element_type=jnp.float32)  # [B, K, G, T, S]
    scores = scores * (head_dim ** -0.5)
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # [B, T, S]
    visible = (distance >= 0) & (key_positions[:, None, :] >= 0)  # [B, T, S]
    if sliding_window is not None:
        visible &= distance < sliding_window
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)  # [B, K, G, T, S]
    weights = jax.nn.softmax(scores, axis=-1).astype(values.dtype)  # [B, K, G, T, S]
    out = jnp.einsum("bkgts,bskh->btkgh", weights, values)  # [B, T, K, G, H]
    return out.reshape(batch, num_queries, num_heads, head_dim)  # [B, T, N, H]


class Attention(nnx.Module):
    """Multi-head attention with grouped key/value heads, RoPE and optional q/k/v bias."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        param_dtype = dtype_of(config.param_dtype)
        self.dtype = dtype_of(config.dtype)
        self.sliding_window = config.sliding_window
        self.config = config
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = make_linear(rngs, (d, n, h), ("embed", "q_heads", "head_dim"),
                                  param_dtype)
        self.k_proj = make_linear(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"),
                                  param_dtype)
        self.v_proj = make_linear(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"),
                                  param_dtype)
        self.o_proj = make_linear(rngs, (n, h, d), ("q_heads", "head_dim", "embed"),
                                  param_dtype, input_axes=2)
        if config.attention_bias:
            zeros = jax.nn.initializers.zeros
            self.q_bias = make_param(rngs, (n, h), ("q_heads", "head_dim"), param_dtype, zeros)
            self.k_bias = make_param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, zeros)
            self.v_bias = make_param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, zeros)
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.activation_hooks: ActivationHooks | None = None  # see `jaxinfer.models.hooks`

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: LayerCache | PagedLayerCache | None = None,
    ) -> tuple[jax.Array, LayerCache | PagedLayerCache | None]:
        """Attends the tokens `x` to themselves and to the cache.

        Args:
            x: `[B, T, D]` hidden states; with a paged cache, B = 1 and the T tokens are the
                packed ragged batch described by `cache.batch`.
            positions: `[B, T]` int32 positions; with a contiguous cache they are also the
                slots the new keys and values are written to (slots past its end are dropped).
            cache: This layer's contiguous or paged cache, or None to attend within `x` only.

        Returns:
            `([B, T, D]` outputs, the updated cache or None`)`.
        """
        inv_freq = inverse_frequencies(self.config)  # [H/2], a host constant of the config
        x = linear_input(self, "attention_input", x)  # [B, T, D]
        queries, keys, values = (
            out if bias is None else out + bias[...].astype(self.dtype)
            for out, bias in zip(project_together(x, [self.q_proj, self.k_proj, self.v_proj]),
                                 [self.q_bias, self.k_bias, self.v_bias], strict=True)
        )  # [B, T, N, H], [B, T, K, H], [B, T, K, H]
        queries = apply_rope(queries, positions, inv_freq)  # [B, T, N, H]
        keys = apply_rope(keys, positions, inv_freq)  # [B, T, K, H]
        keys, values = cached_keys_values(self, keys, values)  # [B, T, K, H] each
        queries = constrain(queries, ("batch", "length", "act_heads", None))
        keys = constrain(keys, ("batch", "length", "act_kv_heads", None))
        values = constrain(values, ("batch", "length", "act_kv_heads", None))

        if isinstance(cache, PagedLayerCache):
            return self._paged(queries, keys, values, cache)
        if cache is None:
            all_keys, all_values, key_positions = keys, values, positions  # S = T: no cache
        else:
            rows = jnp.arange(x.shape[0])[:, None]  # [B, 1]
            all_keys = cache.keys.at[rows, positions].set(
                keys.astype(cache.keys.dtype), mode="drop")  # [B, S, K, H]
            all_values = cache.values.at[rows, positions].set(
                values.astype(cache.values.dtype), mode="drop")  # [B, S, K, H]
            cache = LayerCache(all_keys, all_values)
            slots = jnp.arange(all_keys.shape[1], dtype=jnp.int32)  # [S]
            key_positions = jnp.broadcast_to(slots, (x.shape[0], slots.shape[0]))  # [B, S]
            all_keys, all_values = all_keys.astype(self.dtype), all_values.astype(self.dtype)

        attended = dot_product_attention(queries, all_keys, all_values, positions,
                                         key_positions, self.sliding_window)  # [B, T, N, H]
        out = self._output_projection(attended)  # [B, T, D]
        return out, cache

    def _output_projection(self, attended: jax.Array) -> jax.Array:
        """`[B, T, N, H]` attention outputs to `[B, T, D]` through o_proj."""
        attended = linear_input(self, "attention_output", attended)  # [B, T, N, H]
        batch, length, num_heads, head_dim = attended.shape
        # One [N*H, D] matmul (see `LinearParam`), float or quantized alike.
        return self.o_proj(attended.reshape(batch, length, num_heads * head_dim))  # [B, T, D]

    def _paged(self, queries: jax.Array, keys: jax.Array, values: jax.Array,
               cache: PagedLayerCache) -> tuple[jax.Array, PagedLayerCache]:
        """Writes this step's keys and values into the pages, then ragged paged attention over them.

        An 8-bit pool (with scales) quantizes the new rows as it writes them, and attention
        dequantizes the rows it reads; a KIVI pool (scales a `KiviPool`) quantizes the pages
        this step completes and keeps each sequence's partial last page in its residual seat
        (`batch.residual_slots`); a float pool is read in the compute dtype.

        Under tensor parallelism (the active layout splits KV heads over a mesh axis of
        `shards` devices) each shard runs this on its own heads: its queries
        `[T, N/shards, H]`, its new keys and values `[T, K/shards, H]` and its slice
        `[L, P, Z, 2K/shards, H]` of the pool, which holds exactly those KV heads because
        keys and values are interleaved per head. Attention needs nothing from other heads, so
        the block runs without communication; o_proj then sums over heads.
        """
        batch = cache.batch
        axis = active_axis("act_kv_heads")
        layer = jnp.asarray(cache.layer, jnp.int32)  # [] this block's layer of the pool
        # attended [T, N, H], pages [L, P, Z, 2K, H], scales [L, P, Z, 2K] or None
        if axis is None:
            attended, pages, scales = self._paged_local(queries[0], keys[0], values[0],
                                                        cache.pages, cache.scales, layer,
                                                        batch)
        else:
            heads = PartitionSpec(None, axis, None)  # [T, N|K, H]
            pool = PartitionSpec(None, None, None, axis, None)  # [L, P, Z, 2K, H]
            scales_spec = scale_spec(cache.scales, axis)
            attended, pages, scales = jax.shard_map(
                self._paged_local,
                in_specs=(heads, heads, heads, pool, scales_spec, PartitionSpec(),
                          PartitionSpec()),
                out_specs=(heads, pool, scales_spec), check_vma=False,
            )(queries[0], keys[0], values[0], cache.pages, cache.scales, layer, batch)
        out = self._output_projection(attended[None])  # [1, T, D]
        return out, PagedLayerCache(pages, batch, scales, cache.layer)

    def _paged_local(self, queries: jax.Array, keys: jax.Array, values: jax.Array,
                     pages: jax.Array, scales: jax.Array | KiviPool | None, layer: jax.Array,
                     batch: PagedBatch
                     ) -> tuple[jax.Array, jax.Array, jax.Array | KiviPool | None]:
        """`_paged` on one shard's heads: queries `[T, N, H]`, keys and values `[T, K, H]`,
        the stacked pool `[L, P, Z, 2K, H]` (scales `[L, P, Z, 2K]`, or a `KiviPool`) and the
        layer to use; returns the attention outputs `[T, N, H]` and the updated pool and
        scales."""
        if scales is None:
            pages = write_to_pages(pages, keys, values, batch.slot_mapping,
                                   layer=layer)  # [L, P, Z, 2K, H]
        elif isinstance(scales, KiviPool):
            pages, scales = write_to_kivi_pages(
                pages, scales, keys, values, batch.slot_mapping, batch.kv_lens,
                batch.cu_q_lens, batch.residual_slots,
                layer=layer)  # [L, P, Z, 2K, H*bits/8] uint8, its KiviPool
        else:
            pages, scales = write_to_quantized_pages(
                pages, scales, keys, values, batch.slot_mapping,
                layer=layer)  # [L, P, Z, 2K, H] int8, [L, P, Z, 2K]
        # A float pool in another dtype than the compute dtype is read as stored and widened
        # to float32 by the attention (as the reference and the kernels do for every pool).
        attended = ragged_paged_attention(
            queries, pages, batch.kv_lens, batch.page_indices, batch.cu_q_lens,
            batch.num_seqs, sm_scale=self.config.head_dim ** -0.5,
            sliding_window=self.sliding_window, kv_scales=scales, layer=layer,
            residual_slots=batch.residual_slots)  # [T, N, H]
        return attended, pages, scales


def scale_spec(scales: jax.Array | KiviPool | None, axis: str
                ) -> PartitionSpec | KiviPool | None:
    """How the arrays beside the pages split over the KV-head mesh axis: the combined (or
    KV) head axis of each, so every shard holds its own heads' scales and residual rows."""
    if scales is None:
        return None
    if isinstance(scales, KiviPool):
        return KiviPool(key_scales=PartitionSpec(None, None, axis, None),  # [L, P, K, H]
                        key_zeros=PartitionSpec(None, None, axis, None),
                        value_scales=PartitionSpec(None, None, None, axis, None),  # [L,P,Z,K,g]
                        value_zeros=PartitionSpec(None, None, None, axis, None),
                        residual=PartitionSpec(None, None, None, axis, None))  # [L,R,Z,2K,H]
    return PartitionSpec(None, None, None, axis)  # [L, P, Z, 2K]
