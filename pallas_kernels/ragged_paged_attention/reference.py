"""Ragged paged attention, the readable float32 reference (and the XLA path off-TPU).

One step of a continuous-batching engine attends a ragged batch: Q sequences, each bringing
some new query tokens (a prefill chunk, or one decode token) packed back to back into one
`[T, N, H]` array, to all of its keys so far, which live in fixed-size pages of a shared pool.

Page layout (the one the engine's cache, this reference and the kernels share):

    kv_pages: [P, Z, 2K, H]   Z = page_size; keys and values interleaved on the head axis:
                              slot 2k holds key head k, slot 2k + 1 value head k

Page p, row r of a sequence whose page table is `page_indices[s]` holds that sequence's token
at position `j * page_size + r` where `page_indices[s, j] == p`. Interleaving K and V keeps one
token's keys and values in one contiguous row, so a kernel fetches both with one DMA.

int8 and fp8 KV caches: the pages may be int8, float8_e4m3fn or float8_e5m2, with one float32
scale per token and combined head

    kv_scales: [P, Z, 2K]     symmetric absmax / (the dtype's largest value: 127 for int8,
                              448 for e4m3, 57344 for e5m2) over the head dim,

so a stored row dequantizes as `kv_pages[p, r, c].astype(f32) * kv_scales[p, r, c]` whatever
the 8-bit dtype (`QUANTIZED_KV_DTYPES`). The scales
mirror the pages without their head-dim axis, so one slot index addresses both.
`write_to_quantized_pages` quantizes as it writes; every implementation takes `kv_scales=`.

KIVI int4 / int2 pools: packed uint8 pages with a `kivi.KiviPool` (key scales per page and
channel, value scales per token and channel group, a float32 residual pool holding each
sequence's partial last page) passed as `kv_scales`, and `residual_slots` `[Q]` (each
sequence's residual seat) beside the batch; `kivi.py` documents the layout.

Stacked layers: a model that scans over its layers keeps every layer's pool in one array,

    kv_pages:  [L, P, Z, 2K, H]   kv_scales: [L, P, Z, 2K]

and passes `layer=` (an int32 scalar, traced inside the scan) to the writes and to attention,
which then index `kv_pages[layer, page]` directly. Slicing `kv_pages[layer]` out first would
copy that layer's whole pool on every call (XLA materializes a dynamic slice of a loop carry
before scattering into it), so the ops take the index instead of the slice.

Ragged batch description (all int32):

    cu_q_lens: [Q + 1]  query token offsets: sequence s owns tokens cu_q_lens[s]:cu_q_lens[s+1]
    kv_lens:   [Q]      keys of sequence s after this step's tokens are written (its new query
                        tokens are the last q_len of them, at positions kv_len - q_len ...)
    num_seqs:  [1]      real sequences; rows past it (and tokens past cu_q_lens[num_seqs])
                        are padding and give zeros

Masking is causal by position, with an optional sliding window W (a query at position p sees
keys at q with p - W < q <= p), matching `jaxinfer.models.attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build
from pallas_kernels.ragged_paged_attention import cpu_rows, kivi

_MASKED = -1e30  # finite, so a fully masked (padding) row stays NaN-free

# The 8-bit page dtypes with one scale per token and head; int8 rounds to integers, the float8
# dtypes round to their own grids (relative precision 2^-4 for e4m3, 2^-3 for e5m2).
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn),
                       jnp.dtype(jnp.float8_e5m2))


def _largest(dtype: jnp.dtype) -> float:
    """The largest magnitude a row's absmax maps to: 127 for int8, the float8 dtype's max."""
    if jnp.issubdtype(dtype, jnp.integer):
        return float(jnp.iinfo(dtype).max)
    return float(jnp.finfo(dtype).max)


def as_stacked(kv_pages: jax.Array, kv_scales: jax.Array | kivi.KiviPool | None,
               layer: jax.Array | int | None
               ) -> tuple[jax.Array, jax.Array | kivi.KiviPool | None, jax.Array | int]:
    """The pool as `[L, P, Z, 2K, H]` (scales `[L, P, Z, 2K]`, or a `KiviPool` of stacked
    arrays) and the layer to use: a one-layer pool (`layer=None`) becomes a stack of one, its
    layer 0 (a free reshape)."""
    if layer is None:
        return kv_pages[None], jax.tree.map(lambda array: array[None], kv_scales), 0
    return kv_pages, kv_scales, layer


def _scatter_rows(pool: jax.Array, rows: jax.Array, slot_mapping: jax.Array,
                  layer: jax.Array | int | None = None) -> jax.Array:
    """Sets `pool[slot] = row` for a flat `[P * Z, ...]` pool, or `pool[layer, slot] = row`
    for a stacked `[L, P * Z, ...]` one; negative slots drop."""
    slots = slot_mapping
    if slots.shape[0] == 1:
        # XLA rewrites a one-row scatter into a dynamic-update-slice that, on CPU, copies the
        # whole pool (3-4 pool copies per layer: a batch-1 decode step ran 5x slower). A second,
        # dropped row keeps it a real scatter, which updates the donated pool in place.
        rows = jnp.concatenate([rows, jnp.zeros_like(rows)])  # [2, ...]
        slots = jnp.concatenate([slots, jnp.full((1,), -1, slots.dtype)])  # [2]
    # Negative slots become out of range so that mode="drop" skips them.
    if layer is None:
        slots = jnp.where(slots < 0, pool.shape[0], slots)  # [T]
        return pool.at[slots].set(rows, mode="drop")
    slots = jnp.where(slots < 0, pool.shape[1], slots)  # [T]
    return pool.at[layer, slots].set(rows, mode="drop")


def _interleave(keys: jax.Array, values: jax.Array) -> jax.Array:
    """`[T, K, H]` keys and values -> `[T, 2K, H]` rows, key head k in slot 2k, value in 2k+1."""
    num_tokens, num_kv_heads, head_dim = keys.shape
    return jnp.stack([keys, values], axis=2).reshape(num_tokens, 2 * num_kv_heads,
                                                     head_dim)  # [T, 2K, H]


def _flat(pool: jax.Array, layer: jax.Array | int | None) -> jax.Array:
    """`[P, Z, ...]` -> `[P * Z, ...]`, or `[L, P, Z, ...]` -> `[L, P * Z, ...]` with a layer."""
    lead = 0 if layer is None else 1
    shape = pool.shape
    return pool.reshape(*shape[:lead], shape[lead] * shape[lead + 1], *shape[lead + 2:])


def write_to_pages(kv_pages: jax.Array, keys: jax.Array, values: jax.Array,
                   slot_mapping: jax.Array, *, layer: jax.Array | int | None = None
                   ) -> jax.Array:
    """Writes new keys and values into their page slots.

    Args:
        kv_pages: `[P, Z, 2K, H]` the pool (one layer's), or with `layer` the stacked
            `[L, P, Z, 2K, H]` pool of every layer.
        keys: `[T, K, H]` new keys, one per token.
        values: `[T, K, H]` new values.
        slot_mapping: `[T]` int32 flat slot `page * page_size + row` of each token; negative
            slots (padding tokens) are dropped.
        layer: int32 scalar: the layer of a stacked pool to write; None for a one-layer pool.

    Returns:
        The updated pool, shaped as given.
    """
    rows = _interleave(keys, values).astype(kv_pages.dtype)  # [T, 2K, H]
    flat = _flat(kv_pages, layer)  # [P*Z, 2K, H] or [L, P*Z, 2K, H]
    return _scatter_rows(flat, rows, slot_mapping, layer).reshape(kv_pages.shape)


def quantize_kv_rows(rows: jax.Array, dtype: jnp.dtype = jnp.int8
                     ) -> tuple[jax.Array, jax.Array]:
    """Symmetric 8-bit per row over the last axis: `[..., H]` -> `dtype` `[..., H]`, f32 `[...]`.

    Args:
        rows: `[..., H]` float rows.
        dtype: One of `QUANTIZED_KV_DTYPES`: int8 rounds `rows / scale` to the nearest integer,
            a float8 dtype rounds it to the nearest value of its grid (round to nearest even).

    Returns:
        The quantized rows and their scales `absmax / largest`, largest = 127 for int8, the
        float8 dtype's max otherwise.
    """
    dtype = jnp.dtype(dtype)
    largest = _largest(dtype)
    rows = rows.astype(jnp.float32)
    scales = jnp.max(jnp.abs(rows), axis=-1) / largest  # [...]
    # An all-zero row keeps scale 0 (it dequantizes to zeros); divide by 1 there instead.
    scaled = rows / jnp.where(scales > 0, scales, 1.0)[..., None]  # [..., H] in [-max, max]
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    # The clip keeps a rounding of absmax / scale just past max from becoming inf or NaN.
    return jnp.clip(scaled, -largest, largest).astype(dtype), scales


def write_to_quantized_pages(kv_pages: jax.Array, kv_scales: jax.Array, keys: jax.Array,
                             values: jax.Array, slot_mapping: jax.Array, *,
                             layer: jax.Array | int | None = None
                             ) -> tuple[jax.Array, jax.Array]:
    """Quantizes new keys and values to the pool's 8-bit dtype (int8, float8_e4m3fn or
    float8_e5m2; one scale per token and head) and writes them.

    Args:
        kv_pages: `[P, Z, 2K, H]` 8-bit pool (one layer's), or with `layer` the stacked
            `[L, P, Z, 2K, H]` pool.
        kv_scales: `[P, Z, 2K]` float32 scales of the pool's rows (`[L, P, Z, 2K]` stacked).
        keys: `[T, K, H]` new float keys.
        values: `[T, K, H]` new float values.
        slot_mapping: `[T]` int32 flat slots; negative slots are dropped.
        layer: int32 scalar: the layer of a stacked pool to write; None for a one-layer pool.

    Returns:
        The updated `(kv_pages, kv_scales)`, shaped as given.
    """
    quantized, scales = quantize_kv_rows(_interleave(keys, values),
                                         kv_pages.dtype)  # [T, 2K, H], [T, 2K]
    flat_pages = _flat(kv_pages, layer)  # [P*Z, 2K, H] or [L, P*Z, 2K, H]
    flat_scales = _flat(kv_scales, layer)  # [P*Z, 2K] or [L, P*Z, 2K]
    if jnp.issubdtype(kv_pages.dtype, jnp.floating):
        def as_bytes() -> jax.Array:
            # Float8 rows scattered as their bytes (XLA widened a float8 scatter's whole pool to
            # float16 and back).
            to_bytes = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
            written = _scatter_rows(to_bytes(flat_pages), to_bytes(quantized), slot_mapping, layer)
            return jax.lax.bitcast_convert_type(written, kv_pages.dtype).reshape(kv_pages.shape)

        def in_place() -> jax.Array:
            # XLA:CPU copies the whole pool for that bitcast too: the C++ handler writes the
            # rows in place. The pool goes in its own shape: XLA copied a reshaped, loop-carried
            # pool to alias it.
            stacked = kv_pages if layer is not None else kv_pages[None]  # [L, P, Z, 2K, H]
            return cpu_rows.write_rows(stacked, quantized, slot_mapping,
                                       0 if layer is None else layer).reshape(kv_pages.shape)

        pages = cpu_build.on_cpu(in_place, as_bytes,
                                 supported=cpu_rows.supports(kv_pages))  # [(L,) P, Z, 2K, H]
    else:
        pages = _scatter_rows(flat_pages, quantized, slot_mapping, layer)  # [(L,) P*Z, 2K, H]
    return (pages.reshape(kv_pages.shape),
            _scatter_rows(flat_scales, scales, slot_mapping, layer).reshape(kv_scales.shape))


def dequantize_pages(kv_pages: jax.Array, kv_scales: jax.Array | None) -> jax.Array:
    """Float32 rows of (a gather of) the pool: `[..., 2K, H]` times `[..., 2K]` scales, if any."""
    if kv_scales is None:
        return kv_pages.astype(jnp.float32)
    return kv_pages.astype(jnp.float32) * kv_scales[..., None].astype(jnp.float32)


def ragged_paged_attention_reference(
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
            the stacked `[L, P, Z, 2K, H]` pool).
        kv_lens: `[Q]` int32 key count of each sequence (this step's tokens included).
        page_indices: `[Q, pages_per_seq]` int32 page table of each sequence.
        cu_q_lens: `[Q + 1]` int32 query offsets.
        num_seqs: `[1]` int32 number of real sequences.
        sm_scale: Softmax scale (usually head_dim ** -0.5).
        sliding_window: Keys visible per query (itself included), or None for all.
        soft_cap: Logit soft-cap (Gemma-2 style `cap * tanh(s / cap)`), or None.
        kv_scales: `[P, Z, 2K]` scales of an 8-bit pool (`[L, P, Z, 2K]` stacked), a
            `kivi.KiviPool` of a KIVI pool, or None for a float pool.
        layer: int32 scalar: the layer of a stacked pool to read; None for a one-layer pool.
        residual_slots: `[Q]` int32 residual seat of each sequence (KIVI pools only).

    Returns:
        `[T, N, H]` outputs in the queries' dtype; zeros for padding tokens.
    """
    kv_pages, kv_scales, layer = as_stacked(kv_pages, kv_scales, layer)  # [L, P, Z, 2K, H]
    num_tokens, num_heads, head_dim = queries.shape
    num_kv_heads = kv_pages.shape[3] // 2
    group = num_heads // num_kv_heads
    max_seqs, pages_per_seq = page_indices.shape
    page_size = kv_pages.shape[2]
    max_len = pages_per_seq * page_size

    token = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    # Sequence of each token: the s with cu_q_lens[s] <= t < cu_q_lens[s + 1].
    sequence = jnp.clip(jnp.searchsorted(cu_q_lens[1:], token, side="right"), 0,
                        max_seqs - 1).astype(jnp.int32)  # [T]
    real = token < cu_q_lens[num_seqs[0]]  # [T]
    # A token's position: the sequence's new tokens are the last q_len of its kv_len keys.
    position = kv_lens[sequence] - (cu_q_lens[sequence + 1] - token)  # [T]

    if isinstance(kv_scales, kivi.KiviPool):
        gathered = kivi.read_pages(
            kv_pages, kv_scales, layer, page_indices,
            jnp.arange(pages_per_seq, dtype=jnp.int32)[None, :], kv_lens[:, None],
            residual_slots[:, None])  # [Q, pages_per_seq, Z, 2K, H]
    else:
        gathered = dequantize_pages(
            kv_pages[layer, page_indices],
            None if kv_scales is None else kv_scales[layer, page_indices])
    gathered = gathered.reshape(max_seqs, max_len, 2 * num_kv_heads,
                                head_dim)  # [Q, S, 2K, H]
    keys = gathered[:, :, 0::2][sequence]  # [T, S, K, H]
    values = gathered[:, :, 1::2][sequence]  # [T, S, K, H]

    grouped = queries.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group,
                                                  head_dim)  # [T, K, G, H]
    scores = jnp.einsum("tkgh,tskh->tkgs", grouped, keys) * sm_scale  # [T, K, G, S]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_position = jnp.arange(max_len, dtype=jnp.int32)  # [S]
    distance = position[:, None] - key_position[None, :]  # [T, S]
    visible = (distance >= 0) & (key_position[None, :] < kv_lens[sequence][:, None])  # [T, S]
    if sliding_window is not None:
        visible &= distance < sliding_window
    visible &= real[:, None]
    scores = jnp.where(visible[:, None, None, :], scores, _MASKED)  # [T, K, G, S]
    weights = jax.nn.softmax(scores, axis=-1)  # [T, K, G, S]
    out = jnp.einsum("tkgs,tskh->tkgh", weights, values)  # [T, K, G, H]
    out = jnp.where(real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(queries.dtype)  # [T, N, H]
