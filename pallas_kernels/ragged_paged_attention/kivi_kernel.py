"""Ragged paged attention over a KIVI (int4 / int2) pool, as a Pallas TPU kernel (tested in
interpret mode on CPU).

The walk is `kernel.py`'s, its shared pieces in `walk.py` (a program per block of query
tokens, every KV head in it; each sequence whose tokens meet the tile walks its pages in
blocks of `pages_per_block`, copied HBM -> VMEM asynchronously and double-buffered; online
softmax in f32). What differs is what a block copies and how it becomes keys and values
(`kivi.py` has the layout):

- per page: the packed code rows `[Z, 2K, H * bits / 8]` uint8, the key scales and zero
  points `[K, H]` and the value scales and zero points `[Z, K, H / g]` (float16);
- per sequence, once: its residual seat `[Z, 2K, H]` float32 (`residual_slots` is
  scalar-prefetched with the page tables).

Inside the block the codes are unpacked with shifts and masks, keys scaled per channel and
values per channel group, and the page that is the sequence's partial last one
(`kv_len // Z`) is taken from the seat instead. Only dequantized tiles exist, in VMEM, never a
float copy of the pool. Every KV head is one program's (E = K): the packed head axis is
copied whole, which is aligned whatever HBM's tiling of uint8 rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.kivi import KiviPool, bits_of
from pallas_kernels.ragged_paged_attention.reference import as_stacked
from pallas_kernels.ragged_paged_attention.walk import (
    fold_block,
    key_block_range,
    regroup_queries,
    start_accumulators,
    ungroup_output,
    visible_keys,
    walk_pages,
    write_output,
)


def _dequantized_head(codes: jax.Array, key_scales: jax.Array, key_zeros: jax.Array,
                      value_scales: jax.Array, value_zeros: jax.Array, h: int, bits: int
                      ) -> tuple[jax.Array, jax.Array]:
    """Keys and values `[pages, Z, H]` of head h from a block's codes `[pages, Z, 2K, Hp]`,
    key scales `[pages, K, H]` and value scales `[pages, Z, K, H / g]`."""
    per_byte = 8 // bits
    packed = codes[:, :, 2 * h:2 * h + 2, :].astype(jnp.int32)  # [pages, Z, 2, Hp]
    shifts = jax.lax.broadcasted_iota(jnp.int32, (*packed.shape, per_byte), 4) * bits
    unpacked = (packed[..., None] >> shifts) & (2 ** bits - 1)  # [pages, Z, 2, Hp, per_byte]
    unpacked = unpacked.reshape(*packed.shape[:3], -1).astype(jnp.float32)  # [pages, Z, 2, H]
    keys = (unpacked[:, :, 0] * key_scales[:, h][:, None, :].astype(jnp.float32)
            + key_zeros[:, h][:, None, :].astype(jnp.float32))  # [pages, Z, H]
    pages, page_size, head_dim = keys.shape
    groups = value_scales.shape[-1]
    values = unpacked[:, :, 1].reshape(pages, page_size, groups, head_dim // groups)
    values = (values * value_scales[:, :, h][..., None].astype(jnp.float32)
              + value_zeros[:, :, h][..., None].astype(jnp.float32))
    return keys, values.reshape(pages, page_size, head_dim)  # [pages, Z, H] each


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, layer_ref, seats_ref,
    # inputs
    queries_ref,  # [K, rows, H] the tile's query rows (block_tokens * G), every head
    kv_pages_hbm,  # [L, P, Z, 2K, Hp] packed codes, left in HBM
    key_scales_hbm, key_zeros_hbm,  # [L, P, K, H]
    value_scales_hbm, value_zeros_hbm,  # [L, P, Z, K, H/g]
    residual_hbm,  # [L, R, Z, 2K, H]
    out_ref,  # [K, rows, H]
    # scratch
    buffer,  # [2, pages_per_block, Z, 2K, Hp]
    key_scale_buffer, key_zero_buffer,  # [2, pages_per_block, K, H]
    value_scale_buffer, value_zero_buffer,  # [2, pages_per_block, Z, K, H/g]
    semaphores,  # [5, 2, pages_per_block]
    seat_buffer,  # [Z, 2K, H]
    seat_semaphore,  # [1]
    running_max, denominator,  # [K, rows, 1]
    accumulator,  # [K, rows, H]
    *, bits: int, group: int, block_tokens: int, pages_per_block: int, pages_per_seq: int,
    sm_scale: float, sliding_window: int | None, soft_cap: float | None,
):
    num_kv_heads = queries_ref.shape[0]
    tile = pl.program_id(0)
    layer = layer_ref[0]
    page_size = buffer.shape[2]
    rows = block_tokens * group
    block_keys = pages_per_block * page_size
    tile_start = tile * block_tokens
    tile_end = tile_start + block_tokens

    start_accumulators(running_max, denominator, accumulator)
    queries = [queries_ref[h].astype(jnp.float32) * sm_scale
               for h in range(num_kv_heads)]  # K x [rows, H]
    row_token = tile_start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group

    def sequence_body(sequence, carry):
        query_start = cu_q_lens_ref[sequence]
        query_end = cu_q_lens_ref[sequence + 1]
        kv_len = kv_lens_ref[sequence]

        @pl.when((query_start < tile_end) & (query_end > tile_start) & (kv_len > 0))
        def _attend():
            first_block, end_block = key_block_range(
                kv_len, query_start, query_end, tile_start, tile_end, block_keys,
                sliding_window)
            # The sequence's partial last page, whose rows its residual seat holds.
            seat_copy = pltpu.make_async_copy(residual_hbm.at[layer, seats_ref[sequence]],
                                              seat_buffer, seat_semaphore.at[0])
            seat_copy.start()
            seat_copy.wait()

            def copies(block, slot):
                result = []
                for page in range(pages_per_block):
                    entry = jnp.minimum(block * pages_per_block + page, pages_per_seq - 1)
                    physical = page_indices_ref[sequence * pages_per_seq + entry]
                    sources = (kv_pages_hbm, key_scales_hbm, key_zeros_hbm, value_scales_hbm,
                               value_zeros_hbm)
                    targets = (buffer, key_scale_buffer, key_zero_buffer, value_scale_buffer,
                               value_zero_buffer)
                    for index, (source, target) in enumerate(zip(sources, targets,
                                                                 strict=True)):
                        result.append(pltpu.make_async_copy(
                            source.at[layer, physical], target.at[slot, page],
                            semaphores.at[index, slot, page]))
                return result

            def attend_block(block, slot):
                page_number = block * pages_per_block + jax.lax.broadcasted_iota(
                    jnp.int32, (pages_per_block, 1, 1), 0)  # [pages, 1, 1]
                partial = page_number == kv_len // page_size  # [pages, 1, 1]
                seat = seat_buffer[...]  # [Z, 2K, H]
                visible = visible_keys(block, block_keys, kv_len, query_start, query_end,
                                       row_token, sliding_window)  # [rows, S]
                for h in range(num_kv_heads):
                    keys, values = _dequantized_head(
                        buffer[slot], key_scale_buffer[slot], key_zero_buffer[slot],
                        value_scale_buffer[slot], value_zero_buffer[slot], h,
                        bits)  # [pages, Z, H] each
                    keys = jnp.where(partial, seat[None, :, 2 * h], keys).reshape(
                        block_keys, -1)  # [S, H]
                    values = jnp.where(partial, seat[None, :, 2 * h + 1], values).reshape(
                        block_keys, -1)  # [S, H]
                    fold_block(h, queries[h], keys, values, visible, running_max, denominator,
                               accumulator, soft_cap)

            walk_pages(first_block, end_block, copies, attend_block)

        return carry

    jax.lax.fori_loop(0, num_seqs_ref[0], sequence_body, 0)
    write_output(out_ref, denominator, accumulator)


def ragged_paged_attention_kivi_kernel(
    queries: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    kv_scales: KiviPool,
    residual_slots: jax.Array,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: jax.Array | int | None = None,
    block_tokens: int = 16,
    pages_per_block: int = 4,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Attention of packed query tokens to their sequences' KIVI pages, as one Pallas call.

    Args:
        queries: `[T, N, H]` packed query tokens of all sequences.
        kv_pages: `[L, P, Z, 2K, H * bits / 8]` packed codes (with `layer`; `[P, Z, 2K, Hp]`
            without), this step's rows already written.
        kv_lens, page_indices, cu_q_lens, num_seqs: The ragged batch (`reference.py`).
        sm_scale: Softmax scale.
        kv_scales: The pool's `KiviPool`.
        residual_slots: `[Q]` int32 each sequence's residual seat.
        sliding_window: Keys visible per query (itself included), or None for all.
        soft_cap: Logit soft-cap, or None.
        layer: int32 scalar: the layer to read; None for a one-layer pool.
        block_tokens: Packed query tokens per program.
        pages_per_block: Pages copied and computed together.
        interpret: `pallas_call`'s interpret argument (False compiles for TPU).

    Returns:
        `[T, N, H]` in the queries' dtype; zeros for padding tokens.
    """
    kv_pages, pool, layer = as_stacked(kv_pages, kv_scales, layer)
    num_tokens, num_heads, head_dim = queries.shape
    combined_heads = kv_pages.shape[3]
    num_kv_heads = combined_heads // 2
    group = num_heads // num_kv_heads
    max_seqs, pages_per_seq = page_indices.shape
    pages_per_block = min(pages_per_block, pages_per_seq)
    regrouped = regroup_queries(queries, num_kv_heads, block_tokens)  # [K, T' * G, H]
    num_tiles = regrouped.shape[1] // (block_tokens * group)
    rows = block_tokens * group

    kernel = functools.partial(
        _kernel, bits=bits_of(kv_pages, pool), group=group, block_tokens=block_tokens,
        pages_per_block=pages_per_block, pages_per_seq=pages_per_seq, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    row_block = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda tile, *_: (0, tile, 0))
    in_hbm = pl.BlockSpec(memory_space=pltpu.MemorySpace.HBM)
    double = (2, pages_per_block)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_tiles,),
        in_specs=[row_block] + [in_hbm] * 6,
        out_specs=row_block,
        scratch_shapes=[
            pltpu.VMEM((*double, *kv_pages.shape[2:]), kv_pages.dtype),
            pltpu.VMEM((*double, *pool.key_scales.shape[2:]), pool.key_scales.dtype),
            pltpu.VMEM((*double, *pool.key_zeros.shape[2:]), pool.key_zeros.dtype),
            pltpu.VMEM((*double, *pool.value_scales.shape[2:]), pool.value_scales.dtype),
            pltpu.VMEM((*double, *pool.value_zeros.shape[2:]), pool.value_zeros.dtype),
            pltpu.SemaphoreType.DMA((5, *double)),
            pltpu.VMEM(pool.residual.shape[2:], jnp.float32),
            pltpu.SemaphoreType.DMA((1,)),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(regrouped.shape, queries.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(kv_lens.astype(jnp.int32), page_indices.reshape(max_seqs * pages_per_seq).astype(
        jnp.int32), cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32),
      jnp.asarray(layer, jnp.int32).reshape(1), residual_slots.astype(jnp.int32), regrouped,
      kv_pages, pool.key_scales, pool.key_zeros, pool.value_scales, pool.value_zeros,
      pool.residual)  # [K, T' * G, H]
    return ungroup_output(out, num_tokens, num_heads)  # [T, N, H]
