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

_MASKED = -1e30  # finite: a row that sees nothing keeps exp(...) == 0 instead of NaN


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

    running_max[...] = jnp.full(running_max.shape, _MASKED, jnp.float32)
    denominator[...] = jnp.zeros(denominator.shape, jnp.float32)
    accumulator[...] = jnp.zeros(accumulator.shape, jnp.float32)
    queries = [queries_ref[h].astype(jnp.float32) * sm_scale
               for h in range(heads_per_block)]  # E x [rows, H]
    row_token = tile_start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group  # [rows, 1]

    def sequence_body(sequence, carry):
        query_start = cu_q_lens_ref[sequence]
        query_end = cu_q_lens_ref[sequence + 1]
        kv_len = kv_lens_ref[sequence]

        @pl.when((query_start < tile_end) & (query_end > tile_start) & (kv_len > 0))
        def _attend():
            # Keys this tile's tokens of the sequence can see: from the window's start of the
            # tile's first token to the last token's position.
            last_token = jnp.minimum(query_end, tile_end) - 1
            first_token = jnp.maximum(query_start, tile_start)
            last_position = kv_len - (query_end - last_token)
            first_key = 0
            if sliding_window is not None:
                first_position = kv_len - (query_end - first_token)
                first_key = jnp.maximum(first_position - sliding_window + 1, 0)
            first_block = first_key // block_keys
            end_block = last_position // block_keys + 1

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

            for copy in copies(first_block, first_block % 2):
                copy.start()

            def block_body(block, inner_carry):
                slot = block % 2

                @pl.when(block + 1 < end_block)
                def _prefetch_next():
                    for copy in copies(block + 1, (block + 1) % 2):
                        copy.start()

                for copy in copies(block, slot):
                    copy.wait()
                pages = buffer[slot]  # [pages_per_block, Z, 2E, H]
                if quantized:
                    pages = pages.astype(jnp.float32)
                    page_scales = scale_buffer[slot]  # [pages_per_block, Z, 2K]
                    column = jax.lax.broadcasted_iota(jnp.int32, page_scales.shape, 2)
                key_position = block * block_keys + jax.lax.broadcasted_iota(
                    jnp.int32, (1, block_keys), 1)  # [1, S]
                row_position = kv_len - (query_end - row_token)  # [rows, 1]
                visible = ((row_token >= query_start) & (row_token < query_end)
                           & (key_position <= row_position) & (key_position < kv_len))
                if sliding_window is not None:
                    visible &= row_position - key_position < sliding_window
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
                    scores = jax.lax.dot_general(
                        queries[h], keys, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)  # [rows, S]
                    if soft_cap is not None:
                        scores = soft_cap * jnp.tanh(scores / soft_cap)
                    scores = jnp.where(visible, scores, _MASKED)  # [rows, S]
                    previous_max = running_max[h]  # [rows, 1]
                    new_max = jnp.maximum(previous_max, jnp.max(scores, axis=1, keepdims=True))
                    rescale = jnp.exp(previous_max - new_max)  # [rows, 1]
                    probabilities = jnp.where(visible, jnp.exp(scores - new_max),
                                              0.0)  # [rows, S]
                    denominator[h] = denominator[h] * rescale + jnp.sum(
                        probabilities, axis=1, keepdims=True)
                    accumulator[h] = accumulator[h] * rescale + jax.lax.dot_general(
                        probabilities, values, (((1,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32)  # [rows, H]
                    running_max[h] = new_max
                return inner_carry

            jax.lax.fori_loop(first_block, end_block, block_body, 0)

        return carry

    jax.lax.fori_loop(0, num_seqs_ref[0], sequence_body, 0)
    total = denominator[...]  # [E, rows, 1]
    out_ref[...] = (accumulator[...] / jnp.where(total > 0, total, 1.0)).astype(out_ref.dtype)


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
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    max_seqs, pages_per_seq = page_indices.shape
    pages_per_block = min(pages_per_block, pages_per_seq)
    num_tiles = -(-num_tokens // block_tokens)
    padded_tokens = num_tiles * block_tokens
    rows = block_tokens * group

    # The barrier keeps the regrouping below on the (small) queries: without it the TPU
    # compiler moved the transpose into the layout of the projection that made them, and
    # copied the whole q_proj weight into that layout every step (found compiling
    # Llama-3-8B's step for v5e: 4 MiB per layer and chip).
    queries = jax.lax.optimization_barrier(queries)  # [T, N, H]
    regrouped = queries.reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, K, G, H]
    regrouped = jnp.pad(regrouped, ((0, padded_tokens - num_tokens), (0, 0), (0, 0), (0, 0)))
    regrouped = regrouped.transpose(1, 0, 2, 3).reshape(
        num_kv_heads, padded_tokens * group, head_dim)  # [K, T' * G, H]

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
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, padded_tokens * group, head_dim),
                                       queries.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(kv_lens.astype(jnp.int32), page_indices.reshape(max_seqs * pages_per_seq).astype(
        jnp.int32), cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32),
      jnp.asarray(layer, jnp.int32).reshape(1), regrouped,
      kv_pages, *([kv_scales.astype(jnp.float32)] if quantized else []))  # [K, T' * G, H]
    out = out.reshape(num_kv_heads, padded_tokens, group, head_dim).transpose(
        1, 0, 2, 3)  # [T', K, G, H]
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim)  # [T, N, H]
