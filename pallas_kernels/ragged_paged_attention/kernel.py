"""Ragged paged attention as a Pallas TPU kernel (runs on CPU in TPU interpret mode).

One kernel serves a whole engine step: decodes, whole prefills and prefill chunks whose keys
reach back past their queries, packed back to back (`reference.py` documents the page layout
and the ragged batch description, which this kernel shares).

Work split. The wrapper regroups the queries per KV head, `[T, N, H]` -> `[K, T * G, H]`
(row `t * G + g` is query head `k * G + g` of token t), so one program owns a block of
`heads_per_block` KV heads (E) and a tile of `block_tokens` packed tokens, and every matmul is
a plain 2-D `[rows, H] x [H, S]` (S: the keys of one block of pages), one per head of the block.
The grid is `(K / E, T / block_tokens)`; both axes are independent ("parallel").
E is 1 for float pages. For int8 pages it is 4 (or K when K is not a multiple of 4): HBM tiles
an int8 `[2K, H]` row in `(8, 128)` tiles, so a page copy may only start at a multiple of 8 on
the combined head axis, i.e. at every fourth KV head; one head's 2 rows cannot be copied alone.
With one head block (E = K) the copy starts at a static row 0, aligned whatever the tiling.

Inside a program. Page tables, lengths and query offsets are scalar-prefetched into SMEM.
For every sequence whose tokens intersect the tile, the kernel walks that sequence's pages in
blocks of `pages_per_block`, copying each block's pages (this head block's key and value
rows only, `[Z, 2E, H]` per page) from HBM into VMEM with asynchronous copies,
double-buffered: block j + 1's copies are in flight while block j is computed. Scores are
masked causally by position, to the sequence's own rows, and to the optional sliding window,
optionally soft-capped (`cap * tanh(s / cap)`), and folded into an online softmax (running
max, denominator, weighted sum in f32 VMEM scratch). Rows of padding tokens stay zero.

int8 KV. With `kv_scales` the pages are int8 and each block's per-token scales are copied
beside them (`[Z, 2K]` per page, every head's: the whole row, as slicing the lane axis at a
head would be unaligned). Each head picks its key and value scale columns with an iota mask
(its column index is dynamic) and scales the keys and values after widening them to f32 in
VMEM, so the page bytes read from HBM stay one per element.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, layer_ref,
    # inputs
    queries_ref,  # [E, rows, H] this head block's query rows of the tile (block_tokens * G)
    kv_pages_hbm,  # [L, P, Z, 2K, H] the whole stacked pool, left in HBM
    *refs,
    quantized: bool,
    group: int,
    heads_per_block: int,
    block_tokens: int,
    pages_per_block: int,
    pages_per_seq: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    if quantized:
        # kv_scales_hbm [L, P, Z, 2K]; scale_buffer [2, pages_per_block, Z, 2K]
        (kv_scales_hbm, out_ref, buffer, semaphores, scale_buffer, scale_semaphores,
         running_max, denominator, accumulator) = refs
    else:
        out_ref, buffer, semaphores, running_max, denominator, accumulator = refs
    # out_ref [E, rows, H]; buffer [2, pages_per_block, Z, 2E, H] double-buffered key and
    # value pages; semaphores [2, pages_per_block]; running_max, denominator [E, rows, 1] f32;
    # accumulator [E, rows, H] f32.
    head_block = pl.program_id(0)
    if kv_pages_hbm.shape[3] == 2 * heads_per_block:
        # One program owns every head: a static 0, which Mosaic knows is tile-aligned. The
        # dynamic `0 * 2E` is only known to be a multiple of 2E, and HBM tiles a narrow int8
        # head axis (2K = 2: one KV head, as at TP = K) in 4 rows, so Mosaic rejected it.
        first_row = 0
    else:
        first_row = pl.multiple_of(head_block * (2 * heads_per_block), 2 * heads_per_block)
    tile = pl.program_id(1)
    layer = layer_ref[0]
    page_size = buffer.shape[2]
    rows = block_tokens * group
    block_keys = pages_per_block * page_size
    tile_start = tile * block_tokens
    tile_end = tile_start + block_tokens

    start_accumulators(running_max, denominator, accumulator)
    queries = [queries_ref[h].astype(jnp.float32) * sm_scale
               for h in range(heads_per_block)]  # E x [rows, H]
    row_token = tile_start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group  # [rows, 1]

    def sequence_body(sequence, carry):
        query_start = cu_q_lens_ref[sequence]
        query_end = cu_q_lens_ref[sequence + 1]
        kv_len = kv_lens_ref[sequence]

        @pl.when((query_start < tile_end) & (query_end > tile_start) & (kv_len > 0))
        def _attend():
            first_block, end_block = key_block_range(
                kv_len, query_start, query_end, tile_start, tile_end, block_keys,
                sliding_window)

            def copies(block, slot):
                result = []
                for page in range(pages_per_block):
                    entry = jnp.minimum(block * pages_per_block + page, pages_per_seq - 1)
                    physical = page_indices_ref[sequence * pages_per_seq + entry]
                    result.append(pltpu.make_async_copy(
                        kv_pages_hbm.at[layer, physical, :,
                                        pl.ds(first_row, 2 * heads_per_block), :],
                        buffer.at[slot, page], semaphores.at[slot, page]))
                    if quantized:
                        result.append(pltpu.make_async_copy(
                            kv_scales_hbm.at[layer, physical],
                            scale_buffer.at[slot, page], scale_semaphores.at[slot, page]))
                return result

            def attend_block(block, slot):
                pages = buffer[slot]  # [pages_per_block, Z, 2E, H]
                if quantized:
                    pages = pages.astype(jnp.float32)
                    page_scales = scale_buffer[slot]  # [pages_per_block, Z, 2K]
                    column = jax.lax.broadcasted_iota(jnp.int32, page_scales.shape, 2)
                visible = visible_keys(block, block_keys, kv_len, query_start, query_end,
                                       row_token, sliding_window)  # [rows, S]
                for h in range(heads_per_block):
                    keys = pages[:, :, 2 * h, :].reshape(block_keys, -1).astype(
                        jnp.float32)  # [S, H]
                    values = pages[:, :, 2 * h + 1, :].reshape(block_keys, -1).astype(
                        jnp.float32)  # [S, H]
                    if quantized:
                        key_column = first_row + 2 * h

                        def scales_of(index):
                            picked = jnp.where(column == index, page_scales, 0.0)
                            return jnp.sum(picked, axis=2, keepdims=True).reshape(
                                block_keys, 1)  # [S, 1]

                        keys = keys * scales_of(key_column)
                        values = values * scales_of(key_column + 1)
                    fold_block(h, queries[h], keys, values, visible, running_max, denominator,
                               accumulator, soft_cap)

            walk_pages(first_block, end_block, copies, attend_block)

        return carry

    jax.lax.fori_loop(0, num_seqs_ref[0], sequence_body, 0)
    write_output(out_ref, denominator, accumulator)


def int8_heads_per_block(num_kv_heads: int) -> int:
    """KV heads per program for an int8 pool: 4 (8 rows of the combined head axis, one HBM
    tile of int8), or all K when K is not a multiple of 4 (a whole-axis copy is aligned)."""
    return 4 if num_kv_heads % 4 == 0 else num_kv_heads


def ragged_paged_attention_kernel(
    queries: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    block_tokens: int = 16,
    pages_per_block: int = 4,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Attention of packed query tokens to their sequences' paged keys, as one Pallas call.

    Args:
        queries: `[T, N, H]` packed query tokens of all sequences.
        kv_pages: `[P, Z, 2K, H]` the page pool, keys and values interleaved on the
            head axis, with this step's keys already written (with `layer`: the stacked
            `[L, P, Z, 2K, H]` pool, whose pages the kernel copies from `[layer, page]`).
        kv_lens: `[Q]` int32 key count of each sequence (this step's tokens included).
        page_indices: `[Q, pages_per_seq]` int32 page tables.
        cu_q_lens: `[Q + 1]` int32 query offsets.
        num_seqs: `[1]` int32 number of real sequences.
        sm_scale: Softmax scale.
        sliding_window: Keys visible per query (itself included), or None for all.
        soft_cap: Logit soft-cap (Gemma-2 style), or None.
        kv_scales: `[P, Z, 2K]` float32 scales of an int8 pool (`[L, P, Z, 2K]` stacked), or
            None.
        layer: int32 scalar: the layer of a stacked pool to read (scalar-prefetched with the
            page tables); None for a one-layer pool.
        block_tokens: Packed query tokens per program.
        pages_per_block: Pages copied and computed together.
        interpret: `pallas_call`'s interpret argument (False compiles for TPU).

    Returns:
        `[T, N, H]` in the queries' dtype; zeros for padding tokens.

    Raises:
        ValueError: Heads that do not group evenly over the KV heads.
    """
    kv_pages, kv_scales, layer = as_stacked(kv_pages, kv_scales, layer)  # [L, P, Z, 2K, H]
    num_tokens, num_heads, head_dim = queries.shape
    _, _, page_size, combined_heads, _ = kv_pages.shape
    num_kv_heads = combined_heads // 2
    group = num_heads // num_kv_heads
    max_seqs, pages_per_seq = page_indices.shape
    pages_per_block = min(pages_per_block, pages_per_seq)
    regrouped = regroup_queries(queries, num_kv_heads, block_tokens)  # [K, T' * G, H]
    num_tiles = regrouped.shape[1] // (block_tokens * group)
    rows = block_tokens * group

    quantized = kv_scales is not None
    heads_per_block = int8_heads_per_block(num_kv_heads) if quantized else 1
    kernel = functools.partial(
        _kernel, quantized=quantized, group=group, heads_per_block=heads_per_block,
        block_tokens=block_tokens,
        pages_per_block=pages_per_block, pages_per_seq=pages_per_seq, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    row_block = pl.BlockSpec((heads_per_block, rows, head_dim),
                             lambda head_block, tile, *_: (head_block, tile, 0))
    in_hbm = pl.BlockSpec(memory_space=pltpu.MemorySpace.HBM)
    page_scratch = [pltpu.VMEM((2, pages_per_block, page_size, 2 * heads_per_block, head_dim),
                               kv_pages.dtype),
                    pltpu.SemaphoreType.DMA((2, pages_per_block))]
    if quantized:
        page_scratch += [pltpu.VMEM((2, pages_per_block, page_size, combined_heads),
                                    jnp.float32),
                         pltpu.SemaphoreType.DMA((2, pages_per_block))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_kv_heads // heads_per_block, num_tiles),
        in_specs=[row_block, in_hbm] + ([in_hbm] if quantized else []),
        out_specs=row_block,
        scratch_shapes=[
            *page_scratch,
            pltpu.VMEM((heads_per_block, rows, 1), jnp.float32),
            pltpu.VMEM((heads_per_block, rows, 1), jnp.float32),
            pltpu.VMEM((heads_per_block, rows, head_dim), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(regrouped.shape, queries.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(kv_lens.astype(jnp.int32), page_indices.reshape(max_seqs * pages_per_seq).astype(
        jnp.int32), cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32),
      jnp.asarray(layer, jnp.int32).reshape(1), regrouped,
      kv_pages, *([kv_scales.astype(jnp.float32)] if quantized else []))  # [K, T' * G, H]
    return ungroup_output(out, num_tokens, num_heads)  # [T, N, H]
