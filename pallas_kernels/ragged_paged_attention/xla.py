"""Ragged paged attention in plain XLA, without per-token gathers: the fast path off-TPU.

The reference gathers every query token's whole page table (`[T, pages_per_seq * page_size]`
keys, up to max_model_len whatever the actual lengths): readable, but a 400-token prefill
chunk copies its sequence's keys 400 times. This version splits each token's keys in two
parts and merges their softmax statistics (running max, denominator, weighted sum), as flash
attention merges blocks:

1. **This step's keys** (the chunk itself, causal): attention over the T packed tokens,
   reading the new keys and values back from their page slots (`[T, 2K, H]`, one row per
   token); dense and block-diagonal for small T, and for T a multiple of 2 x `QUERY_BLOCK` in
   tiles, each query tile walking only the key tiles of its own sequences up to the diagonal.
   Decode tokens see only themselves here.
2. **Earlier keys** (the context before the step, which every token of a sequence sees):
   - for decode sequences (one new token), one query row per sequence walks its pages one at a
     time with an online softmax (on XLA:CPU, the C++ kernel of `cpu.py` does this walk);
     sequences are sorted by length and walked in groups of `DECODE_SEQUENCE_GROUP`, each up to
     its own longest context (a dynamic trip count, so short sequences cost about what they
     are);
   - for the few sequences that bring several tokens *and* have a context (later chunks of a
     chunked prefill, prefix-cache hits, recomputation after preemption), a loop over just
     those sequences walks their pages against the packed tokens.

Same arguments, page layout, masking and results (within float32 rounding) as
`reference.ragged_paged_attention_reference`, which the tests compare it against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build
from pallas_kernels.ragged_paged_attention import cpu, cpu_rows, kivi
from pallas_kernels.ragged_paged_attention.reference import as_stacked, dequantize_pages

# Per query row (a token, or a decode sequence): running max [rows, K, G], denominator
# [rows, K, G], weighted sum of values [rows, K, G, H].
Stats = tuple[jax.Array, jax.Array, jax.Array]


def _empty_stats(rows: int, num_kv_heads: int, group: int, head_dim: int) -> Stats:
    return (jnp.full((rows, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((rows, num_kv_heads, group), jnp.float32),
            jnp.zeros((rows, num_kv_heads, group, head_dim), jnp.float32))


def _block_stats(scores: jax.Array, values: jax.Array, value_spec: str) -> Stats:
    """Softmax statistics of one block of (already masked, -inf) scores `[rows, K, G, S]`."""
    block_max = jnp.max(scores, axis=-1)  # [rows, K, G]
    safe_max = jnp.where(jnp.isfinite(block_max), block_max, 0.0)  # [rows, K, G]
    probabilities = jnp.exp(scores - safe_max[..., None])  # [rows, K, G, S]
    weighted = jnp.einsum(value_spec, probabilities, values)  # [rows, K, G, H]
    return block_max, jnp.sum(probabilities, axis=-1), weighted


def _merge(a: Stats, b: Stats) -> Stats:
    """Combines the statistics of two disjoint key sets (log-sum-exp rescaling)."""
    max_a, denominator_a, weighted_a = a
    max_b, denominator_b, weighted_b = b
    new_max = jnp.maximum(max_a, max_b)  # [rows, K, G]
    # A side that has seen no visible key has max -inf; rescaling by exp(-inf) = 0 drops it.
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    scale_a = jnp.exp(max_a - safe_max)  # [rows, K, G]
    scale_b = jnp.exp(max_b - safe_max)  # [rows, K, G]
    return (new_max, denominator_a * scale_a + denominator_b * scale_b,
            weighted_a * scale_a[..., None] + weighted_b * scale_b[..., None])


def _soft_capped(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """`cap * tanh(scores / cap)` (before masking), or the scores unchanged."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


# Query tokens per tile of the blocked step attention (used when T is a multiple >= 2x), and
# of the context walk of long chunks.
QUERY_BLOCK = 128
# Query tokens per tile of the context walk of short multi-token sequences (up to 8 tokens:
# a speculative step's R + 1, a short chunk).
SHORT_QUERY_TILE = 8


def _step_visible(query_sequence: jax.Array, query_position: jax.Array, query_real: jax.Array,
                  key_sequence: jax.Array, key_position: jax.Array, key_real: jax.Array,
                  window: int | jax.Array) -> jax.Array:
    """`[Tq, Tk]` mask: same sequence, causal, inside the window, both real tokens."""
    distance = query_position[:, None] - key_position[None, :]
    return ((query_sequence[:, None] == key_sequence[None, :]) & (distance >= 0)
            & (distance < window) & query_real[:, None] & key_real[None, :])


def _blocked_step_attention(grouped: jax.Array, keys: jax.Array, values: jax.Array,
                            sequence: jax.Array, position: jax.Array, real: jax.Array,
                            cu_q_lens: jax.Array, window: int | jax.Array,
                            soft_cap: float | None = None) -> Stats:
    """This step's keys, tile by tile: each query tile walks only the key tiles from its
    first sequence's start to itself, so a batch of short prompts costs what its sequences
    are, not T^2 (a dense [T, K, G, T] block over 1024 packed tokens was 70% of a prefill).

    Args:
        grouped: `[T, K, G, H]` scaled queries; keys, values: `[T, K, H]` this step's.
        sequence, position, real: `[T]` each token's sequence, position and realness.
        cu_q_lens: `[Q + 1]` query offsets.
        window: Keys visible per query.
        soft_cap: Logit soft-cap, or None.

    Returns:
        The softmax statistics of every token over this step's keys.
    """
    num_tokens, num_kv_heads, group, head_dim = grouped.shape
    block = QUERY_BLOCK
    per_block = []
    for query_block in range(num_tokens // block):
        rows = slice(query_block * block, (query_block + 1) * block)
        queries = grouped[rows]  # [block, K, G, H]
        first_key = cu_q_lens[sequence[query_block * block]]  # the tile's first sequence start

        def key_tile(key_block: jax.Array, carry: Stats, rows: slice = rows,
                     queries: jax.Array = queries) -> Stats:
            start = key_block * block
            tile_keys = jax.lax.dynamic_slice_in_dim(keys, start, block)  # [block, K, H]
            tile_values = jax.lax.dynamic_slice_in_dim(values, start, block)  # [block, K, H]
            scores = _soft_capped(jnp.einsum("tkgh,ukh->tkgu", queries, tile_keys),
                                  soft_cap)  # [block, K, G, block]
            visible = _step_visible(
                sequence[rows], position[rows], real[rows],
                jax.lax.dynamic_slice_in_dim(sequence, start, block),
                jax.lax.dynamic_slice_in_dim(position, start, block),
                jax.lax.dynamic_slice_in_dim(real, start, block), window)  # [block, block]
            scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
            return _merge(carry, _block_stats(scores, tile_values, "tkgu,ukh->tkgh"))

        per_block.append(jax.lax.fori_loop(
            first_key // block, query_block + 1, key_tile,
            _empty_stats(block, num_kv_heads, group, head_dim)))
    return tuple(jnp.concatenate(parts) for parts in zip(*per_block, strict=True))


def _pages(kv_pages: jax.Array, kv_scales: jax.Array | kivi.KiviPool | None,
           layer: jax.Array | int, index: jax.Array, page_number: jax.Array | None = None,
           kv_lens: jax.Array | None = None, seats: jax.Array | None = None) -> jax.Array:
    """Float32 pages (or rows) at `index` of the stacked pool's `layer` (`[L, P, ...]`; one
    gather straight from the pool, no copy of the layer), dequantized when it is 8-bit.

    A KIVI pool reads whole pages only: `page_number` (the pages' place in their sequences'
    tables), `kv_lens` and `seats` (residual seats) say which page is a sequence's partial
    last one, read from the residual pool instead."""
    if isinstance(kv_scales, kivi.KiviPool):
        return kivi.read_pages(kv_pages, kv_scales, layer, index, page_number, kv_lens, seats)
    is_float8 = jnp.issubdtype(kv_pages.dtype, jnp.floating) and kv_pages.dtype.itemsize == 1
    if is_float8:
        def as_bytes() -> jax.Array:
            # Float8 pages gathered as bytes (XLA widened the whole pool to float16 for a
            # float8 gather).
            pool_bytes = jax.lax.bitcast_convert_type(kv_pages, jnp.uint8)  # [L, P, Z, 2K, H]
            return jax.lax.bitcast_convert_type(pool_bytes[layer, index], kv_pages.dtype)

        # XLA:CPU copies the whole pool for that bitcast too: the C++ handler copies out just
        # these pages.
        pages = cpu_build.on_cpu(lambda: cpu_rows.read_rows(kv_pages, layer, index), as_bytes,
                                 supported=cpu_rows.supports(kv_pages))  # [..., Z, 2K, H]
    else:
        pages = kv_pages[layer, index]  # [..., Z, 2K, H]
    return dequantize_pages(pages, None if kv_scales is None else kv_scales[layer, index])


# Decode sequences per page walk: the walk of a group runs to its longest member's context,
# so sorting by length and walking groups of 16 reads ~the real keys instead of Q x the
# longest (64 sequences of 64-384 tokens: 8.8 -> 7.2 ms per layer on 2 CPU cores; smaller
# groups pay more loop overhead than they save).
DECODE_SEQUENCE_GROUP = 16


def _decode_context_stats(kv_pages: jax.Array, kv_scales: jax.Array | kivi.KiviPool | None,
                          layer: jax.Array | int, page_indices: jax.Array,
                          decode_queries: jax.Array, decode_context: jax.Array,
                          decode_position: jax.Array, window: int | jax.Array, windowed: bool,
                          soft_cap: float | None = None,
                          residual_slots: jax.Array | None = None) -> Stats:
    """Earlier keys of the decode sequences: groups of similar length walk their pages.

    Args:
        kv_pages: `[L, P, Z, 2K, H]` the stacked pool.
        kv_scales: `[L, P, Z, 2K]` scales of an 8-bit (int8 or fp8) pool, a KIVI pool's
            `KiviPool`, or None.
        layer: The layer of the pool to read.
        page_indices: `[Q, pages_per_seq]` page tables.
        decode_queries: `[Q, K, G, H]` each sequence's one (scaled) query.
        decode_context: `[Q]` keys before this step (0 for non-decode sequences).
        decode_position: `[Q]` the query's position.
        window: Keys visible per query.
        windowed: Whether a sliding window applies (then walks start at the window).
        soft_cap: Logit soft-cap, or None.
        residual_slots: `[Q]` residual seats of a KIVI pool's sequences, or None.

    Returns:
        Per-sequence softmax statistics `[Q, K, G(, H)]`.
    """
    group = decode_queries.shape[2]
    is_kivi = isinstance(kv_scales, kivi.KiviPool)
    # XLA:CPU: the C++ walk reads each key once, at ~4x this loop's speed (a KIVI page
    # dequantized once per page, in cache, where this loop ran ~25 ops per page).
    return cpu_build.on_cpu(
        lambda: cpu.decode_context_stats(kv_pages, kv_scales, layer, page_indices,
                                         decode_queries, decode_context, decode_position,
                                         window, soft_cap, residual_slots),
        lambda: _decode_walk(kv_pages, kv_scales, layer, page_indices, decode_queries,
                             decode_context, decode_position, window, windowed, soft_cap,
                             residual_slots),
        supported=cpu.supports(kv_pages, group, kivi_pool=is_kivi))


def _decode_walk(kv_pages: jax.Array, kv_scales: jax.Array | kivi.KiviPool | None,
                 layer: jax.Array | int, page_indices: jax.Array, decode_queries: jax.Array,
                 decode_context: jax.Array, decode_position: jax.Array,
                 window: int | jax.Array, windowed: bool, soft_cap: float | None,
                 residual_slots: jax.Array | None) -> Stats:
    """`_decode_context_stats` in XLA: groups of similar length walk their pages."""
    max_seqs = page_indices.shape[0]
    page_size = kv_pages.shape[2]
    _, num_kv_heads, group, head_dim = decode_queries.shape
    group_size = min(DECODE_SEQUENCE_GROUP, max_seqs)
    num_groups = -(-max_seqs // group_size)
    order = jnp.argsort(-decode_context, stable=True).astype(jnp.int32)  # [Q] longest first
    # Pad the last group with a repeat of the shortest sequence (its rows are dropped below).
    order = jnp.concatenate([order, jnp.full((num_groups * group_size - max_seqs,), order[-1],
                                             jnp.int32)])  # [num_groups * group_size]
    per_group = []
    for group_index in range(num_groups):
        rows = order[group_index * group_size:(group_index + 1) * group_size]  # [group_size]
        context = decode_context[rows]  # [group_size]
        queries = decode_queries[rows]  # [group_size, K, G, H]
        position = decode_position[rows]  # [group_size]
        table = page_indices[rows]  # [group_size, pages_per_seq]
        seats = None if residual_slots is None else residual_slots[rows]  # [group_size]

        def decode_page(page: jax.Array, carry: Stats, context: jax.Array = context,
                        queries: jax.Array = queries, position: jax.Array = position,
                        table: jax.Array = table, seats: jax.Array | None = seats) -> Stats:
            block = _pages(kv_pages, kv_scales, layer, table[:, page], page, position + 1,
                           seats)  # [group_size, Z, 2K, H]
            page_scores = _soft_capped(jnp.einsum("qkgh,qzkh->qkgz", queries,
                                                  block[:, :, 0::2]),
                                       soft_cap)  # [group_size, K, G, Z]
            key_position = page * page_size + jnp.arange(page_size)  # [Z]
            page_visible = ((key_position[None, :] < context[:, None])
                            & (position[:, None] - key_position[None, :] < window))
            page_scores = jnp.where(page_visible[:, None, None, :], page_scores, -jnp.inf)
            return _merge(carry, _block_stats(page_scores, block[:, :, 1::2],
                                              "qkgz,qzkh->qkgh"))

        first_page = 0 if not windowed else jnp.maximum(
            jnp.min(jnp.where(context > 0, position - window + 1, jnp.iinfo(jnp.int32).max)),
            0) // page_size
        per_group.append(jax.lax.fori_loop(
            first_page, -(-jnp.max(context) // page_size), decode_page,
            _empty_stats(group_size, num_kv_heads, group, head_dim)))
    inverse = jnp.argsort(order[:max_seqs]).astype(jnp.int32)  # [Q] back to batch order
    return tuple(jnp.concatenate(parts)[:max_seqs][inverse]
                 for parts in zip(*per_group, strict=True))


def ragged_paged_attention_xla(
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
    kv_scales: jax.Array | kivi.KiviPool | None = None,
    layer: jax.Array | int | None = None,
    residual_slots: jax.Array | None = None,
) -> jax.Array:
    """Attention of a ragged batch of query tokens to their sequences' paged keys.

    Args:
        queries: `[T, N, H]` packed query tokens of all sequences.
        kv_pages: `[P, Z, 2K, H]` the page pool, keys and values interleaved (with `layer`:
            the stacked `[L, P, Z, 2K, H]` pool); this step's keys and values must already
            be written.
        kv_lens: `[Q]` int32 key count of each sequence (this step's tokens included).
        page_indices: `[Q, pages_per_seq]` int32 page table of each sequence.
        cu_q_lens: `[Q + 1]` int32 query offsets.
        num_seqs: `[1]` int32 number of real sequences.
        sm_scale: Softmax scale (usually head_dim ** -0.5).
        sliding_window: Keys visible per query (itself included), or None for all.
        soft_cap: Logit soft-cap (`cap * tanh(s / cap)`), or None.
        kv_scales: `[P, Z, 2K]` scales of an 8-bit pool (`[L, P, Z, 2K]` stacked), a KIVI
            pool's `kivi.KiviPool`, or None for a float pool.
        layer: int32 scalar: the layer of a stacked pool to read; None for a one-layer pool.
        residual_slots: `[Q]` int32 residual seat of each sequence (KIVI pools only).

    Returns:
        `[T, N, H]` outputs in the queries' dtype; zeros for padding tokens.
    """
    kv_pages, kv_scales, layer = as_stacked(kv_pages, kv_scales, layer)  # [L, P, Z, 2K, H]
    num_tokens, num_heads, head_dim = queries.shape
    num_layers, num_pages, page_size, combined_heads, _ = kv_pages.shape
    num_kv_heads = combined_heads // 2
    group = num_heads // num_kv_heads
    max_seqs = page_indices.shape[0]
    window = jnp.iinfo(jnp.int32).max if sliding_window is None else sliding_window

    token = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    sequence = jnp.clip(jnp.searchsorted(cu_q_lens[1:], token, side="right"), 0,
                        max_seqs - 1).astype(jnp.int32)  # [T]
    real = token < cu_q_lens[num_seqs[0]]  # [T]
    position = kv_lens[sequence] - (cu_q_lens[sequence + 1] - token)  # [T]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [Q]
    real_seq = jnp.arange(max_seqs) < num_seqs[0]  # [Q]
    context_lens = jnp.where(real_seq, kv_lens - q_lens, 0)  # [Q] keys before this step
    grouped = (queries.astype(jnp.float32) * sm_scale).reshape(
        num_tokens, num_kv_heads, group, head_dim)  # [T, K, G, H]

    # 1. This step's keys: read back from their slots, attended block-diagonally and causally.
    slot = (page_indices[sequence, jnp.clip(position, 0) // page_size] * page_size
            + jnp.clip(position, 0) % page_size)  # [T]
    if isinstance(kv_scales, kivi.KiviPool):
        new_kv = kivi.read_rows(
            kv_pages, kv_scales, layer, jnp.clip(position, 0),
            page_indices[sequence, jnp.clip(position, 0) // page_size], kv_lens[sequence],
            residual_slots[sequence])  # [T, 2K, H]
    else:
        flat_scales = None if kv_scales is None else kv_scales.reshape(
            num_layers, num_pages * page_size, combined_heads)  # [L, P*Z, 2K]
        new_kv = _pages(kv_pages.reshape(num_layers, num_pages * page_size, combined_heads,
                                         head_dim),
                        flat_scales, layer, slot)  # [T, 2K, H]
    new_keys, new_values = new_kv[:, 0::2], new_kv[:, 1::2]  # [T, K, H] each
    if num_tokens >= 2 * QUERY_BLOCK and num_tokens % QUERY_BLOCK == 0:
        stats = _blocked_step_attention(grouped, new_keys, new_values, sequence, position, real,
                                        cu_q_lens, window, soft_cap)
    else:
        scores = _soft_capped(jnp.einsum("tkgh,ukh->tkgu", grouped, new_keys),
                              soft_cap)  # [T, K, G, T]
        visible = _step_visible(sequence, position, real, sequence, position, real, window)
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        stats = _block_stats(scores, new_values, "tkgu,ukh->tkgh")

    # 2a. Earlier keys of decode sequences: one query row per sequence, page by page.
    decode = real_seq & (q_lens == 1)  # [Q]
    decode_context = jnp.where(decode, context_lens, 0)  # [Q]
    last_token = jnp.clip(cu_q_lens[1:] - 1, 0, num_tokens - 1)  # [Q]
    decode_queries = grouped[last_token]  # [Q, K, G, H]
    decode_position = kv_lens - 1  # [Q]

    decode_stats = _decode_context_stats(kv_pages, kv_scales, layer, page_indices,
                                         decode_queries, decode_context, decode_position,
                                         window, sliding_window is not None, soft_cap,
                                         residual_slots)
    # Token t takes its sequence's row only if it is that decode sequence's one token.
    takes_row = decode[sequence] & real  # [T]
    row_stats = jax.tree.map(lambda value: value[sequence], decode_stats)
    row_stats = (jnp.where(takes_row[:, None, None], row_stats[0], -jnp.inf),
                 row_stats[1], row_stats[2])
    stats = _merge(stats, row_stats)

    # 2b. Earlier keys of multi-token sequences that have a context: those sequences only,
    # and of the packed tokens only their own, in query tiles (walking every page against all
    # T tokens cost T / q_len times the work: 8 chunks of 256 over 768 keys each took 18 s
    # instead of ~1.4). Short ones (a speculative step's R + 1 tokens) take small tiles, long
    # chunks `QUERY_BLOCK` ones.
    continued = real_seq & (q_lens > 1) & (context_lens > 0)  # [Q]

    def walk_pages(selected: jax.Array, tile: int, carry: Stats) -> Stats:
        order = jnp.argsort(~selected, stable=True).astype(jnp.int32)  # [Q] selected first

        def one_sequence(index: jax.Array, outer_carry: Stats) -> Stats:
            chosen = order[index]

            def query_tile(tile_index: jax.Array, outer: Stats) -> Stats:
                first = cu_q_lens[chosen] + tile_index * tile  # the tile's first own token
                # Clamped so the slice stays in bounds; rows before `first` are masked out,
                # and merging an all-masked row leaves its statistics exactly as they were.
                start = jnp.minimum(first, num_tokens - tile)
                rows = start + jnp.arange(tile)  # [tile]
                mine = (rows >= first) & (rows < cu_q_lens[chosen + 1]) & real[rows]  # [tile]
                tile_queries = jax.lax.dynamic_slice_in_dim(grouped, start, tile)  # [tile, K, G, H]
                tile_position = position[rows]  # [tile]

                def context_page(page: jax.Array, inner: Stats) -> Stats:
                    block = _pages(kv_pages, kv_scales, layer, page_indices[chosen, page],
                                   page, kv_lens[chosen],
                                   None if residual_slots is None
                                   else residual_slots[chosen])  # [Z, 2K, H]
                    page_scores = _soft_capped(jnp.einsum(
                        "tkgh,zkh->tkgz", tile_queries, block[:, 0::2]), soft_cap)  # [tile,K,G,Z]
                    key_position = page * page_size + jnp.arange(page_size)  # [Z]
                    page_visible = (
                        mine[:, None] & (key_position[None, :] < context_lens[chosen])
                        & (tile_position[:, None] - key_position[None, :] < window))
                    page_scores = jnp.where(page_visible[:, None, None, :], page_scores,
                                            -jnp.inf)
                    return _merge(inner, _block_stats(page_scores, block[:, 1::2],
                                                      "tkgz,zkh->tkgh"))

                tile_stats = jax.lax.fori_loop(
                    0, -(-context_lens[chosen] // page_size), context_page,
                    tuple(jax.lax.dynamic_slice_in_dim(part, start, tile) for part in outer))
                return tuple(jax.lax.dynamic_update_slice_in_dim(part, update, start, 0)
                             for part, update in zip(outer, tile_stats, strict=True))

            return jax.lax.fori_loop(0, -(-q_lens[chosen] // tile), query_tile, outer_carry)

        return jax.lax.fori_loop(0, jnp.sum(selected), one_sequence, carry)

    short_tile = min(SHORT_QUERY_TILE, num_tokens)
    stats = walk_pages(continued & (q_lens <= short_tile), short_tile, stats)
    if num_tokens > short_tile:
        stats = walk_pages(continued & (q_lens > short_tile), min(QUERY_BLOCK, num_tokens),
                           stats)

    _, denominator, weighted = stats
    out = weighted / jnp.where(denominator > 0, denominator, 1.0)[..., None]  # [T, K, G, H]
    out = jnp.where(real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(queries.dtype)  # [T, N, H]
