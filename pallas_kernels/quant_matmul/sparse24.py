"""2:4 semi-structured sparse weights, stored compressed: layout, compression and references.

A `[I, O]` weight is 2:4 sparse when every group of 4 consecutive input rows holds at most 2
non-zeros in each output column. Stored compressed it keeps, per group and column, the 2
kept values and their 2-bit positions within the group (which 2 of the 4):

    values     float (bf16 / f32) or int8: `[I // 2, O]`, "planar": row `s * (I // 4) + g`
               is the s-th kept value (s = 0, 1) of group g (input rows 4g .. 4g + 3).
               int4: `[I // 4, O]` uint8, row g holds both kept values of group g, the
               first in the low nibble (two's complement, as the "int4" format's nibbles).
    positions  `[I // 8, O]` uint8, 4 bits per group: byte `[r, o]` holds group r in its low
               nibble and group `r + I // 8` in its high nibble; a nibble is
               `first | second << 2`, the two positions (0..3) in ascending order.

Why this layout: a TPU kernel expands tiles in VMEM, where splitting rows that are
interleaved along sublanes costs shuffles (or does not lower at all). Planar values give the
two kept values of a tile's groups as two whole tiles; the nibbles of a positions byte belong
to the two halves of I, so one positions tile serves one tile of each half, read through a
second block of the same arrays, and each nibble comes out with bit operations only.

Bytes per parameter (scales aside): bf16 values 1 + positions 1/8 = 1.125, 0.5625x of dense
bf16; int8 values 0.5 + 0.125 = 0.625 (0.3125x of bf16); int4 values 0.25 + 0.125 = 0.375
(0.1875x of bf16). TPUs have no sparse matrix unit: the kernel multiplies the expanded dense
tile, so the gain is HBM bytes (what decode is bound by), not FLOPs.

Compression keeps the 2 largest |w| of each group (ties: the lower position), so a weight
that is already 2:4 compresses exactly, and any other weight is pruned to 2:4 on the way;
`check_2_4` refuses the latter for quantizers that must not prune silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_matmul import reference

GROUP = 4  # inputs per group
KEPT = 2  # values kept per group
# Input rows must fill whole positions bytes: 2 groups (one per half of I) of 4 rows.
ROW_MULTIPLE = 2 * GROUP * 2
_HIGHEST = jax.lax.Precision.HIGHEST


def check_shape(k: int) -> None:
    """Raises ValueError unless `k` input rows fit the compressed layout."""
    if k <= 0 or k % ROW_MULTIPLE:
        raise ValueError(f"2:4 sparse weights need input rows I a multiple of {ROW_MULTIPLE} "
                         f"(two groups of 4 per positions byte, one in each half of I), "
                         f"got I={k}")


def check_2_4(w: jax.Array) -> None:
    """Raises ValueError naming the first group with more than 2 non-zeros.

    A traced weight (under `jit` or `eval_shape`, as when a checkpoint's structure is built
    abstractly) cannot be inspected and passes unchecked.

    Args:
        w: `[I, O]` weight.
    """
    if isinstance(w, jax.core.Tracer):
        return
    k, n = w.shape
    check_shape(k)
    nonzeros = np.count_nonzero(np.asarray(w).reshape(k // GROUP, GROUP, n), axis=1)  # [I/4, O]
    violating = np.argwhere(nonzeros > KEPT)
    if violating.size:
        group, column = (int(index) for index in violating[0])
        raise ValueError(
            f"weight is not 2:4 sparse: input rows {GROUP * group}..{GROUP * group + 3} of "
            f"output column {column} (group {group}) hold {int(nonzeros[group, column])} "
            f"non-zeros, at most {KEPT} allowed ({len(violating)} groups violate); prune it "
            f"to 2:4 first (e.g. keep the 2 largest |w| of every 4 inputs)")


def kept_positions(w: jax.Array) -> jax.Array:
    """The positions of the 2 largest |w| in each group of 4 input rows, ascending.

    Args:
        w: `[I, O]` weight.

    Returns:
        `[I // 4, 2, O]` int32 in 0..3, first < second.
    """
    k, n = w.shape
    magnitudes = jnp.abs(w.astype(jnp.float32)).reshape(k // GROUP, GROUP, n)  # [I/4, 4, O]
    # A stable sort of -|w| keeps the lower position first among equal magnitudes, so the
    # choice is deterministic for groups with fewer than 2 non-zeros.
    order = jnp.argsort(-magnitudes, axis=1, stable=True)[:, :KEPT]  # [I/4, 2, O]
    return jnp.sort(order, axis=1).astype(jnp.int32)  # [I/4, 2, O]


def gather_kept(dense: jax.Array, positions: jax.Array) -> jax.Array:
    """The entries of `[I, O]` `dense` at `[I // 4, 2, O]` positions, as `[2, I // 4, O]`."""
    k, n = dense.shape
    groups = dense.reshape(k // GROUP, GROUP, n)  # [I/4, 4, O]
    kept = jnp.take_along_axis(groups, positions, axis=1)  # [I/4, 2, O]
    return kept.swapaxes(0, 1)  # [2, I/4, O]


def expand(kept: jax.Array, positions: jax.Array) -> jax.Array:
    """The dense `[I, O]` matrix of `[2, I // 4, O]` kept values at `[I // 4, 2, O]` positions
    (zeros elsewhere), in the kept values' dtype."""
    _, groups, n = kept.shape
    slots = jnp.arange(GROUP)[None, :, None]  # [1, 4, 1]
    dense = jnp.zeros((groups, GROUP, n), kept.dtype)  # [I/4, 4, O]
    for slot in range(KEPT):
        dense = jnp.where(positions[:, slot, None, :] == slots, kept[slot, :, None, :], dense)
    return dense.reshape(groups * GROUP, n)  # [I, O]


def prune_2_4(w: jax.Array) -> jax.Array:
    """`w` with all but the 2 largest |w| of each group of 4 input rows set to zero.

    Args:
        w: `[I, O]` weight, I a multiple of 4.

    Returns:
        `[I, O]` in `w`'s dtype.
    """
    positions = kept_positions(w)  # [I/4, 2, O]
    return expand(gather_kept(w, positions), positions)  # [I, O]


def pack_positions(positions: jax.Array) -> jax.Array:
    """`[I // 4, 2, O]` positions to `[I // 8, O]` uint8 (see the module docstring)."""
    nibbles = positions[:, 0] | (positions[:, 1] << 2)  # [I/4, O]
    low, high = jnp.split(nibbles, 2, axis=0)  # [I/8, O] each: the two halves of I
    return (low | (high << 4)).astype(jnp.uint8)  # [I/8, O]


def unpack_positions(packed: jax.Array) -> jax.Array:
    """`[I // 8, O]` uint8 to `[I // 4, 2, O]` int32 positions; inverts `pack_positions`."""
    packed = packed.astype(jnp.int32)  # [I/8, O]
    nibbles = jnp.concatenate([packed & 0xF, packed >> 4], axis=0)  # [I/4, O]
    return jnp.stack([nibbles & 3, nibbles >> 2], axis=1)  # [I/4, 2, O]


def planar_values(kept: jax.Array) -> jax.Array:
    """`[2, I // 4, O]` kept values as the stored `[I // 2, O]` (first values, then second)."""
    slots, groups, n = kept.shape
    return kept.reshape(slots * groups, n)  # [I/2, O]


def kept_values(values: jax.Array) -> jax.Array:
    """Stored `[I // 2, O]` float or int8 values as `[2, I // 4, O]`."""
    rows, n = values.shape
    return values.reshape(KEPT, rows // KEPT, n)  # [2, I/4, O]


def pack_kept_int4(levels: jax.Array) -> jax.Array:
    """`[2, I // 4, O]` int4 levels (-8..7) to `[I // 4, O]` uint8, first in the low nibble."""
    nibbles = levels.astype(jnp.int32) & 0xF  # [2, I/4, O]
    return (nibbles[0] | (nibbles[1] << 4)).astype(jnp.uint8)  # [I/4, O]


def unpack_kept_int4(packed: jax.Array) -> jax.Array:
    """`[I // 4, O]` uint8 to `[2, I // 4, O]` int32 levels in -8..7."""
    packed = packed.astype(jnp.int32)  # [I/4, O]
    # Sign extension of a 4-bit two's-complement number: flip the sign bit, subtract it.
    return jnp.stack([((packed & 0xF) ^ 8) - 8, ((packed >> 4) ^ 8) - 8])  # [2, I/4, O]


# --- the three value kinds: compress a dense weight, and expand it back -----------------------


def compress_float(w: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """`(values [I // 2, O] in dtype, positions [I // 8, O] uint8)` of an `[I, O]` weight."""
    check_shape(w.shape[0])
    positions = kept_positions(w)  # [I/4, 2, O]
    values = planar_values(gather_kept(w, positions).astype(dtype))  # [I/2, O]
    return values, pack_positions(positions)


def compress_int8(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(values [I // 2, O] int8, scales [O] float32, positions [I // 8, O] uint8)`.

    The scales are those of the dense weight ("int8"'s per-channel rule): the dropped
    entries are zeros, which never set a column's maximum.
    """
    check_shape(w.shape[0])
    positions = kept_positions(w)  # [I/4, 2, O]
    levels, scales = reference.quantize_int8_per_channel(w)  # [I, O], [O]
    values = planar_values(gather_kept(levels, positions))  # [I/2, O]
    return values, scales, pack_positions(positions)


def compress_int4(w: jax.Array, group_size: int, bits: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(values [I // 4, O] uint8, scales [C, O] float32, positions [I // 8, O] uint8)`.

    Symmetric group-wise scales by "int4"'s rule over each group of `group_size` input rows
    (zeros included, which do not change a group's maximum).
    """
    k, n = w.shape
    check_shape(k)
    if group_size <= 0 or group_size % GROUP or k % group_size:
        raise ValueError(f"sparse24_int4 group_size must be a multiple of {GROUP} dividing "
                         f"I; got I={k}, group_size={group_size}")
    positions = kept_positions(w)  # [I/4, 2, O]
    groups = w.astype(jnp.float32).reshape(k // group_size, group_size, n)  # [C, gs, O]
    scales, _ = reference.grouped_quantization_parameters(groups, bits, symmetric=True)
    levels = reference.quantize_groups(groups, scales, None, bits).reshape(k, n)  # [I, O]
    values = pack_kept_int4(gather_kept(levels, positions))  # [I/4, O]
    return values, scales, pack_positions(positions)


def expand_float(values: jax.Array, positions: jax.Array) -> jax.Array:
    """Stored float values and positions to the dense `[I, O]` float32 weight."""
    return expand(kept_values(values).astype(jnp.float32), unpack_positions(positions))


def expand_int8(values: jax.Array, scales: jax.Array, positions: jax.Array) -> jax.Array:
    """Stored int8 values, `[O]` scales and positions to the dense `[I, O]` float32 weight."""
    levels = expand(kept_values(values), unpack_positions(positions))  # [I, O] int8
    return reference.dequantize_int8_per_channel(levels, scales)  # [I, O]


def expand_int4(values: jax.Array, scales: jax.Array, positions: jax.Array,
                group_size: int) -> jax.Array:
    """Stored int4 values, `[C, O]` scales and positions to the dense `[I, O]` float32 weight."""
    levels = expand(unpack_kept_int4(values), unpack_positions(positions))  # [I, O] int32
    return reference.dequantize_grouped(levels, scales, None, group_size)  # [I, O]


def dense_matmul_reference(x: jax.Array, dense: jax.Array,
                           out_dtype: jnp.dtype | None) -> jax.Array:
    """`[T, I] x [I, O]` in float32 at full precision, cast to `out_dtype` (default x's)."""
    product = jnp.matmul(x.astype(jnp.float32), dense, precision=_HIGHEST)  # [T, O]
    return product.astype(out_dtype or x.dtype)
