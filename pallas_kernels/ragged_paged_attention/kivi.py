"""KIVI pages (int4 / int2 KV cache): quantize, pack, write inside the step, and read back.

KIVI (Liu et al. 2024, arXiv 2402.02750) quantizes keys per channel and values per token,
asymmetrically, and keeps the newest tokens in full precision. In the paged pool:

    kv_pages:     [L, P, Z, 2K, H * bits / 8] uint8   codes, 8 / bits per byte (element h of
                                                      a row in byte h // (8/bits), low bits
                                                      first); keys and values interleaved
                                                      on the head axis as for float pages
    key_scales:   [L, P, K, H] float16   per page and key channel: the page's Z tokens are
    key_zeros:    [L, P, K, H] float16   one group (KIVI's per-channel key groups)
    value_scales: [L, P, Z, K, H / g] float16   per token and group of g value channels
    value_zeros:  [L, P, Z, K, H / g] float16
    residual:     [L, R, Z, 2K, H] float32   one page of exact rows per sequence seat

A stored code c dequantizes to `c * scale + zero`; scale = (max - min) / (2^bits - 1) and zero
= min of its group (both rounded to float16 before the codes are chosen, so the codes are the
best for the values actually stored).

A page is quantized when it fills: its key groups need all Z tokens. Until then the rows of a
sequence's last, partly filled page live in the residual pool, in the seat
`residual_slots[s]` the engine gives each running sequence (KIVI's full-precision window:
the newest `kv_len % Z` tokens). A step that completes a page quantizes it from the residual's
earlier rows plus the step's new rows. Full pages are never written again, so prefix caching
shares them as it shares float pages. Reading, every path dequantizes a page's codes with its
scales and takes the rows of page `kv_len // Z` (the partial one) from the residual instead.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build
from pallas_kernels.ragged_paged_attention import cpu_kivi_write


class KiviPool(NamedTuple):
    """The arrays beside a KIVI pool's packed pages (one pytree: it is carried and donated
    whole, and the ops take it as `kv_scales`)."""

    key_scales: jax.Array  # [L, P, K, H] float16
    key_zeros: jax.Array  # [L, P, K, H] float16
    value_scales: jax.Array  # [L, P, Z, K, H / g] float16
    value_zeros: jax.Array  # [L, P, Z, K, H / g] float16
    residual: jax.Array  # [L, R, Z, 2K, H] float32

    @property
    def head_dim(self) -> int:
        return self.residual.shape[-1]

    @property
    def value_group(self) -> int:
        return self.head_dim // self.value_scales.shape[-1]


def create_kivi_pool(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                     head_dim: int, bits: int, value_group: int, num_residual: int
                     ) -> tuple[jax.Array, KiviPool]:
    """The zeroed packed pages `[L, P, Z, 2K, H * bits / 8]` uint8 and their `KiviPool`
    (`num_residual` residual pages: one per sequence seat)."""
    if 8 % bits or head_dim % (8 // bits) or head_dim % value_group:
        raise ValueError(f"KIVI with {bits} bits needs head_dim ({head_dim}) divisible by "
                         f"{8 // bits} and by the value group ({value_group})")
    pages = jnp.zeros((num_layers, num_pages, page_size, 2 * num_kv_heads,
                       head_dim * bits // 8), jnp.uint8)  # [L, P, Z, 2K, H*bits/8]
    key_shape = (num_layers, num_pages, num_kv_heads, head_dim)  # [L, P, K, H]
    value_shape = (num_layers, num_pages, page_size, num_kv_heads,
                   head_dim // value_group)  # [L, P, Z, K, H/g]
    return pages, KiviPool(
        jnp.zeros(key_shape, jnp.float16), jnp.zeros(key_shape, jnp.float16),
        jnp.zeros(value_shape, jnp.float16), jnp.zeros(value_shape, jnp.float16),
        jnp.zeros((num_layers, num_residual, page_size, 2 * num_kv_heads, head_dim),
                  jnp.float32))  # [L, R, Z, 2K, H]


def bits_of(kv_pages: jax.Array, pool: KiviPool) -> int:
    """Bits per code: the packed row width against the head dim."""
    return 8 * kv_pages.shape[-1] // pool.head_dim


# ---------------------------------------------------------------- quantize, pack, unpack


def asymmetric(x: jax.Array, axis: int, bits: int
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Min-max quantization of `x` over `axis` to `bits`-bit codes.

    Returns:
        `(codes, scales, zeros)`: uint8 codes shaped as `x`, and float16 scales and zero
        points with `axis` removed; `codes * scale + zero` approximates `x`.
    """
    x = x.astype(jnp.float32)
    levels = 2 ** bits - 1
    low = jnp.min(x, axis=axis)
    high = jnp.max(x, axis=axis)
    zeros = low.astype(jnp.float16)
    scales = ((high - low) / levels).astype(jnp.float16)
    stored_zero = jnp.expand_dims(zeros.astype(jnp.float32), axis)
    stored_scale = jnp.expand_dims(scales.astype(jnp.float32), axis)
    # A constant group keeps scale 0 and dequantizes to its zero point; divide by 1 there.
    codes = jnp.round((x - stored_zero) / jnp.where(stored_scale > 0, stored_scale, 1.0))
    return jnp.clip(codes, 0, levels).astype(jnp.uint8), scales, zeros


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """`[..., H]` uint8 codes below 2^bits -> `[..., H * bits / 8]` bytes, low bits first."""
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits)  # [per_byte]
    return jnp.sum(grouped.astype(jnp.uint32) << shifts.astype(jnp.uint32), axis=-1,
                   dtype=jnp.uint32).astype(jnp.uint8)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """`[..., H * bits / 8]` bytes -> `[..., H]` uint8 codes (the inverse of `pack`)."""
    per_byte = 8 // bits
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits  # [per_byte]
    codes = (packed[..., None] >> shifts) & jnp.uint8(2 ** bits - 1)  # [..., H/per_byte, per_byte]
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def quantize_pages(rows: jax.Array, bits: int, value_group: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Whole pages of float rows `[M, Z, 2K, H]` -> their KIVI storage.

    Returns:
        Packed pages `[M, Z, 2K, H * bits / 8]`, key scales and zeros `[M, K, H]` (per
        channel over the Z rows), value scales and zeros `[M, Z, K, H / g]` (per row and
        group of `value_group` channels).
    """
    num_pages, page_size, combined, head_dim = rows.shape
    keys = rows[:, :, 0::2]  # [M, Z, K, H]
    values = rows[:, :, 1::2]  # [M, Z, K, H]
    key_codes, key_scales, key_zeros = asymmetric(keys, axis=1, bits=bits)
    grouped = values.reshape(num_pages, page_size, combined // 2, head_dim // value_group,
                             value_group)  # [M, Z, K, H/g, g]
    value_codes, value_scales, value_zeros = asymmetric(grouped, axis=-1, bits=bits)
    value_codes = value_codes.reshape(values.shape)  # [M, Z, K, H]
    codes = jnp.stack([key_codes, value_codes], axis=3).reshape(rows.shape)  # [M, Z, 2K, H]
    return pack(codes, bits), key_scales, key_zeros, value_scales, value_zeros


def dequantize(packed: jax.Array, key_scales: jax.Array, key_zeros: jax.Array,
               value_scales: jax.Array, value_zeros: jax.Array, bits: int) -> jax.Array:
    """Float32 rows of (a gather of) KIVI pages.

    Args:
        packed: `[..., Z, 2K, H * bits / 8]` packed pages (or `[..., 2K, H*bits/8]` rows with
            the Z axis gone from the value scales too).
        key_scales, key_zeros: `[..., K, H]` the pages' key channel scales.
        value_scales, value_zeros: `[..., Z, K, H / g]` (or `[..., K, H / g]` for rows).
        bits: Bits per code.

    Returns:
        `[..., Z, 2K, H]` (or `[..., 2K, H]`) float32.
    """
    codes = unpack(packed, bits).astype(jnp.float32)  # [..., (Z,) 2K, H]
    head_dim = codes.shape[-1]
    keys = codes[..., 0::2, :]  # [..., (Z,) K, H]
    values = codes[..., 1::2, :]  # [..., (Z,) K, H]
    row_axes = keys.ndim - key_scales.ndim  # 1 for pages (the Z axis), 0 for rows
    key_scale = key_scales.astype(jnp.float32).reshape(
        key_scales.shape[:-2] + (1,) * row_axes + key_scales.shape[-2:])
    key_zero = key_zeros.astype(jnp.float32).reshape(key_scale.shape)
    keys = keys * key_scale + key_zero
    group = head_dim // value_scales.shape[-1]
    values = (values.reshape(*values.shape[:-1], head_dim // group, group)
              * value_scales.astype(jnp.float32)[..., None]
              + value_zeros.astype(jnp.float32)[..., None]).reshape(keys.shape)
    return jnp.stack([keys, values], axis=-2).reshape(codes.shape)  # [..., (Z,) 2K, H]


# ---------------------------------------------------------------- the step's writes


def write_to_kivi_pages(kv_pages: jax.Array, pool: KiviPool, keys: jax.Array,
                        values: jax.Array, slot_mapping: jax.Array, kv_lens: jax.Array,
                        cu_q_lens: jax.Array, residual_slots: jax.Array, *,
                        layer: jax.Array | int) -> tuple[jax.Array, KiviPool]:
    """Writes a step's keys and values: pages the step completes are quantized, the rows of
    each sequence's partial last page go to its residual seat.

    Args:
        kv_pages: `[L, P, Z, 2K, H*bits/8]` the packed pool.
        pool: Its `KiviPool`.
        keys: `[T, K, H]` new float keys (the packed ragged batch's tokens).
        values: `[T, K, H]` new float values.
        slot_mapping: `[T]` int32 flat slot `page * Z + row` of each token; negative: padding.
        kv_lens: `[Q]` keys per sequence after this step.
        cu_q_lens: `[Q + 1]` query offsets.
        residual_slots: `[Q]` each sequence's residual seat.
        layer: The layer to write.

    Returns:
        The updated `(kv_pages, pool)`.
    """
    page_size = kv_pages.shape[2]
    num_tokens = keys.shape[0]
    max_seqs = kv_lens.shape[0]
    rows = jnp.stack([keys, values], axis=2).reshape(
        num_tokens, 2 * keys.shape[1], keys.shape[2]).astype(jnp.float32)  # [T, 2K, H]
    token = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    sequence = jnp.clip(jnp.searchsorted(cu_q_lens[1:], token, side="right"), 0,
                        max_seqs - 1).astype(jnp.int32)  # [T]
    kv_len = kv_lens[sequence]  # [T]
    position = kv_len - (cu_q_lens[sequence + 1] - token)  # [T]
    context = kv_len - (cu_q_lens[sequence + 1] - cu_q_lens[sequence])  # [T] keys before
    seat = residual_slots[sequence]  # [T]
    def in_place() -> tuple[jax.Array, KiviPool]:
        # XLA:CPU: only the pages this step completes are quantized, in place (steps 1 and 2).
        pages, *arrays = cpu_kivi_write.write((kv_pages, *pool), rows, slot_mapping, position,
                                              context, kv_len, seat, layer)
        return pages, KiviPool(*arrays)

    return cpu_build.on_cpu(
        in_place, lambda: _write_in_xla(kv_pages, pool, rows, slot_mapping, position, context,
                                        kv_len, seat, max_seqs, layer),
        supported=cpu_kivi_write.supports(page_size))


def _write_in_xla(kv_pages: jax.Array, pool: KiviPool, rows: jax.Array, slot_mapping: jax.Array,
                  position: jax.Array, context: jax.Array, kv_len: jax.Array, seat: jax.Array,
                  max_seqs: int, layer: jax.Array | int) -> tuple[jax.Array, KiviPool]:
    """`write_to_kivi_pages` in XLA (per-token `[T]` position, context, kv_len and seat)."""
    num_pages, page_size = kv_pages.shape[1], kv_pages.shape[2]
    num_tokens = rows.shape[0]
    real = slot_mapping >= 0  # [T]

    # 1. Pages completed this step (a token in a page's last row): their Z rows are the
    # residual's earlier rows and this step's rows, quantized together. At most one per page
    # of tokens plus one per sequence (its first, partly earlier, page).
    completes = real & (position % page_size == page_size - 1)  # [T]
    most = min(num_tokens, num_tokens // page_size + max_seqs)
    (done,) = jnp.nonzero(completes, size=most, fill_value=num_tokens)  # [M]
    valid = done < num_tokens  # [M]
    done = jnp.minimum(done, num_tokens - 1)  # [M]
    offsets = jnp.arange(page_size, dtype=jnp.int32) - (page_size - 1)  # [Z]
    from_step = (position[done][:, None] + offsets) >= context[done][:, None]  # [M, Z]
    step_rows = rows[jnp.clip(done[:, None] + offsets, 0, num_tokens - 1)]  # [M, Z, 2K, H]
    # Rows of each sequence's partial last page go to its residual seat (step 2), after the
    # reads above: a sequence that completes a page and starts the next reuses the seat.
    in_partial = real & (position // page_size == kv_len // page_size)  # [T]
    num_seats = pool.residual.shape[1]
    target = jnp.where(in_partial, seat * page_size + position % page_size,
                       num_seats * page_size)  # [T] rows of the seats' R*Z; R*Z drops
    earlier = pool.residual[layer, seat[done]]  # [M, Z, 2K, H]
    page_rows = jnp.where(from_step[..., None, None], step_rows, earlier)  # [M, Z, 2K, H]
    packed, key_scales, key_zeros, value_scales, value_zeros = quantize_pages(
        page_rows, bits_of(kv_pages, pool), pool.value_group)
    page_ids = jnp.where(valid, slot_mapping[done] // page_size, num_pages)  # [M]; P drops
    kv_pages = kv_pages.at[layer, page_ids].set(packed, mode="drop")
    pool = pool._replace(
        key_scales=pool.key_scales.at[layer, page_ids].set(key_scales, mode="drop"),
        key_zeros=pool.key_zeros.at[layer, page_ids].set(key_zeros, mode="drop"),
        value_scales=pool.value_scales.at[layer, page_ids].set(value_scales, mode="drop"),
        value_zeros=pool.value_zeros.at[layer, page_ids].set(value_zeros, mode="drop"))

    # 2. The residual's rows, indexed (seat, row) in the residual's own shape: XLA copied the
    # whole residual to scatter into a reshape of it.
    residual = pool.residual.at[layer, target // page_size, target % page_size].set(
        rows, mode="drop")
    return kv_pages, pool._replace(residual=residual)


# ---------------------------------------------------------------- reads


def read_pages(kv_pages: jax.Array, pool: KiviPool, layer: jax.Array | int,
               page_ids: jax.Array, page_numbers: jax.Array, kv_lens: jax.Array,
               residual_slots: jax.Array) -> jax.Array:
    """Float32 pages `[..., Z, 2K, H]`: the codes of `page_ids` dequantized, or, for the page
    that is a sequence's partial last one (`page_numbers == kv_lens // Z`), its residual rows.

    Args:
        kv_pages: `[L, P, Z, 2K, H*bits/8]` packed pool.
        pool: Its `KiviPool`.
        layer: The layer to read.
        page_ids: `[...]` physical pages.
        page_numbers: `[...]` each page's index in its sequence's page table.
        kv_lens: `[...]` its sequence's keys (this step's included).
        residual_slots: `[...]` its sequence's residual seat.
    """
    page_size = kv_pages.shape[2]
    stored = dequantize(kv_pages[layer, page_ids], pool.key_scales[layer, page_ids],
                        pool.key_zeros[layer, page_ids], pool.value_scales[layer, page_ids],
                        pool.value_zeros[layer, page_ids],
                        bits_of(kv_pages, pool))  # [..., Z, 2K, H]
    partial = page_numbers == kv_lens // page_size  # [...]
    exact = pool.residual[layer, residual_slots]  # [..., Z, 2K, H]
    return jnp.where(partial[..., None, None, None], exact, stored)


def read_rows(kv_pages: jax.Array, pool: KiviPool, layer: jax.Array | int,
              positions: jax.Array, page_ids: jax.Array, kv_lens: jax.Array,
              residual_slots: jax.Array) -> jax.Array:
    """Float32 rows `[T, 2K, H]` of tokens at `positions` `[T]` in pages `page_ids` `[T]`, of
    sequences with `kv_lens` and `residual_slots` `[T]` (as `read_pages`, row by row)."""
    page_size = kv_pages.shape[2]
    row = positions % page_size  # [T]
    stored = dequantize(kv_pages[layer, page_ids, row], pool.key_scales[layer, page_ids],
                        pool.key_zeros[layer, page_ids],
                        pool.value_scales[layer, page_ids, row],
                        pool.value_zeros[layer, page_ids, row],
                        bits_of(kv_pages, pool))  # [T, 2K, H]
    partial = positions // page_size == kv_lens // page_size  # [T]
    exact = pool.residual[layer, residual_slots, row]  # [T, 2K, H]
    return jnp.where(partial[:, None, None], exact, stored)


def dequantize_pool(kv_pages: jax.Array, pool: KiviPool, page_indices: jax.Array,
                    kv_lens: jax.Array, residual_slots: jax.Array, num_seqs: jax.Array
                    ) -> jax.Array:
    """The float32 pool `[L, P, Z, 2K, H]` a KIVI pool stands for: every page dequantized,
    and each real sequence's partial last page replaced by its residual rows (the oracle
    the attention paths are tested against: dequantize, then attend a float pool)."""
    num_pages, page_size = kv_pages.shape[1:3]
    floats = dequantize(kv_pages, pool.key_scales, pool.key_zeros, pool.value_scales,
                        pool.value_zeros, bits_of(kv_pages, pool))  # [L, P, Z, 2K, H]
    partial_page = jnp.minimum(kv_lens // page_size, page_indices.shape[1] - 1)  # [Q]
    last = jnp.take_along_axis(page_indices, partial_page[:, None], axis=1)[:, 0]  # [Q]
    real = (jnp.arange(kv_lens.shape[0]) < num_seqs[0]) & (kv_lens % page_size > 0)  # [Q]
    targets = jnp.where(real, last, num_pages)  # [Q]; out of range: dropped
    return floats.at[:, targets].set(pool.residual[:, residual_slots],
                                     mode="drop")  # [L, P, Z, 2K, H]
