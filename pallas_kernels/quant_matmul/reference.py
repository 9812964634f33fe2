"""Readable float32 references for weight-quantized matmuls, and the quantizers they share.

Three formats, all with weights laid out `[K, N]` (input features by output features):

    int8   weight-only: int8 values, one float32 scale per output channel (column)
    int4   weight-only: int4 values packed two per byte along K, one float32 scale per
           group of `group_size` rows per column, optionally an int8 zero point per group
    w8a8   int8 weights as above and activations quantized per token (row) on the fly;
           the product accumulates in int32 and is rescaled once at the end

The Pallas kernels in `kernel.py` must match these functions: bit for bit in the int32
accumulator of W8A8, and to float32 rounding (summation order) for the float paths.

Int4 convention: values are signed, in [-8, 7], stored as two's-complement nibbles; the
low nibble of byte `[i, n]` is row `2 * i` and the high nibble is row `2 * i + 1`. An
asymmetric weight keeps its zero point in the same signed domain, so every format
dequantizes as `(value - zero) * scale` with `zero = 0` when symmetric.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127
INT4_MIN, INT4_MAX = -8, 7
# Matmuls in float32 at full precision: on TPU the default precision would round the
# operands to bfloat16 and the reference would stop being a reference.
_HIGHEST = jax.lax.Precision.HIGHEST


def _safe_scale(scale: jax.Array) -> jax.Array:
    # An all-zero channel, group or token would give scale 0 and 0 / 0 = NaN values;
    # any nonzero scale quantizes it to exact zeros instead.
    return jnp.where(scale > 0, scale, 1.0)


def quantize_int8_per_channel(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization with one scale per output channel.

    Args:
        w: `[K, N]` float weights.

    Returns:
        `(values, scales)`: `[K, N]` int8 in [-127, 127] and `[N]` float32, such that
        `values * scales` approximates `w` to within `scales / 2` per element.
    """
    w = w.astype(jnp.float32)  # [K, N]
    scales = _safe_scale(jnp.max(jnp.abs(w), axis=0) / INT8_MAX)  # [N]
    values = jnp.clip(jnp.round(w / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8)  # [K, N]
    return values, scales


def dequantize_int8_per_channel(values: jax.Array, scales: jax.Array) -> jax.Array:
    """`[K, N]` int8 values times `[N]` scales, as `[K, N]` float32."""
    return values.astype(jnp.float32) * scales[None, :]  # [K, N]


def pack_int4(values: jax.Array) -> jax.Array:
    """Packs signed int4 values two per byte along K (low nibble = even row).

    Args:
        values: `[K, N]` integers in [-8, 7]; K even.

    Returns:
        `[K // 2, N]` uint8.
    """
    if values.shape[0] % 2:
        raise ValueError(f"int4 packing needs an even number of rows, got shape {values.shape}")
    nibbles = (values.astype(jnp.int32) & 0xF).astype(jnp.uint8)  # [K, N] two's complement
    low, high = nibbles[0::2], nibbles[1::2]  # [K // 2, N] each
    return low | (high << 4)  # [K // 2, N]


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_int4`: `[K // 2, N]` uint8 to `[K, N]` int8 in [-8, 7]."""
    low = (packed & 0xF).astype(jnp.int32)  # [K // 2, N]
    high = (packed >> 4).astype(jnp.int32)  # [K // 2, N]
    # Sign extension of a 4-bit two's-complement number: flip the sign bit, subtract it.
    low, high = (low ^ 8) - 8, (high ^ 8) - 8
    interleaved = jnp.stack([low, high], axis=1)  # [K // 2, 2, N]
    return interleaved.reshape(-1, packed.shape[1]).astype(jnp.int8)  # [K, N]


def int4_levels(bits: int, symmetric: bool) -> tuple[int, int]:
    """The signed nibble values a `bits`-wide weight may take, as `(lowest, highest)`.

    Symmetric weights use `[-(2^(b-1) - 1), 2^(b-1) - 1]` (no zero point). Asymmetric ones
    use the `2^b` unsigned levels `[0, 2^b - 1]` shifted by -8 into the signed nibble, so
    `value - zero` is the same whether the shift is there or not.

    Raises:
        ValueError: `bits` outside [2, 4] (narrower fits no useful grid; wider needs int8).
    """
    if not 2 <= bits <= 4:
        raise ValueError(f"nibble-packed weights hold 2 to 4 bits, got bits={bits}")
    if symmetric:
        highest = 2 ** (bits - 1) - 1
        return -highest, highest
    return INT4_MIN, INT4_MIN + 2 ** bits - 1


def grouped_quantization_parameters(
    groups: jax.Array, bits: int, *, symmetric: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Scales (and zero points) of weight groups, one per group and output channel.

    Args:
        groups: `[G, g, N]` float weights: G groups of g rows (the reduced axis is 1).
        bits: Bit width, 2 to 4.
        symmetric: True: `scale = max|w| / (2^(b-1) - 1)`, no zero point. False: the
            group's [min, max] maps onto all `2^b` levels through a zero point.

    Returns:
        `(scales, zeros)`: `[G, N]` float32 and `[G, N]` int8 in the signed nibble domain
        (None when symmetric).
    """
    groups = groups.astype(jnp.float32)  # [G, g, N]
    lowest, highest = int4_levels(bits, symmetric)
    if symmetric:
        return _safe_scale(jnp.max(jnp.abs(groups), axis=1) / highest), None  # [G, N]
    low, high = jnp.min(groups, axis=1), jnp.max(groups, axis=1)  # [G, N] each
    scales = _safe_scale((high - low) / (highest - lowest))  # [G, N]
    # The zero point sits on the unsigned grid [0, 2^b - 1], then shifts by -8 like the values.
    unsigned_zeros = jnp.clip(jnp.round(-low / scales), 0, highest - lowest)  # [G, N]
    return scales, (unsigned_zeros + lowest).astype(jnp.int8)


def quantize_groups(
    groups: jax.Array, scales: jax.Array, zeros: jax.Array | None, bits: int
) -> jax.Array:
    """Rounds `[G, g, N]` weights onto the nibble grid of given `[G, N]` scales and zeros.

    Returns:
        `[G, g, N]` int8 values in `int4_levels(bits, zeros is None)`, such that
        `(values - zeros) * scales` is the nearest grid point to each weight (clipped).
    """
    lowest, highest = int4_levels(bits, zeros is None)
    steps = jnp.round(groups.astype(jnp.float32) / scales[:, None])  # [G, g, N]
    if zeros is not None:
        steps = steps + zeros.astype(jnp.float32)[:, None]
    return jnp.clip(steps, lowest, highest).astype(jnp.int8)  # [G, g, N]


def quantize_int4_grouped(
    w: jax.Array, group_size: int, *, symmetric: bool = True, bits: int = 4
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Group-wise int4 (or narrower) quantization along K, packed two values per byte.

    Args:
        w: `[K, N]` float weights; K a multiple of `group_size`.
        group_size: Rows sharing one scale (and zero point); even.
        symmetric: True: values in [-7, 7], no zero point. False: each group's [min, max]
            maps onto all 16 levels through a zero point.
        bits: 4, or 3 or 2 for a coarser grid in the same nibble storage (see `int4_levels`).

    Returns:
        `(packed, scales, zeros)`: `[K // 2, N]` uint8, `[K // group_size, N]` float32 and
        `[K // group_size, N]` int8 in [-8, 7] (None when symmetric). The dequantized
        weight, `(unpack_int4(packed) - zeros) * scales` per group, is within
        `scales / 2` of `w`.

    Raises:
        ValueError: K is not a multiple of `group_size`, `group_size` is odd, or `bits` is
            outside [2, 4].
    """
    k, n = w.shape
    if group_size <= 0 or group_size % 2 or k % group_size:
        raise ValueError(f"int4 group_size must be even and divide K; got K={k} "
                         f"(weight shape {w.shape}), group_size={group_size}")
    groups = w.astype(jnp.float32).reshape(k // group_size, group_size, n)  # [G, g, N]
    scales, zeros = grouped_quantization_parameters(groups, bits, symmetric=symmetric)
    values = quantize_groups(groups, scales, zeros, bits)  # [G, g, N]
    packed = pack_int4(values.reshape(k, n))  # [K // 2, N]
    return packed, scales, zeros


def dequantize_int4_grouped(
    packed: jax.Array, scales: jax.Array, zeros: jax.Array | None, group_size: int
) -> jax.Array:
    """`[K // 2, N]` packed int4 with `[K // group_size, N]` scales/zeros to `[K, N]` f32."""
    values = unpack_int4(packed).astype(jnp.float32)  # [K, N]
    k, n = values.shape
    groups = values.reshape(k // group_size, group_size, n)  # [G, g, N]
    if zeros is not None:
        groups = groups - zeros.astype(jnp.float32)[:, None]  # [G, g, N]
    return (groups * scales[:, None]).reshape(k, n)  # [K, N]


def quantize_per_token_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization of activations with one scale per token (row).

    Args:
        x: `[M, K]` float activations.

    Returns:
        `(values, scales)`: `[M, K]` int8 in [-127, 127] and `[M]` float32.
    """
    x = x.astype(jnp.float32)  # [M, K]
    scales = _safe_scale(jnp.max(jnp.abs(x), axis=1) / INT8_MAX)  # [M]
    values = jnp.clip(jnp.round(x / scales[:, None]), -INT8_MAX, INT8_MAX)  # [M, K]
    return values.astype(jnp.int8), scales


def int8_matmul_reference(
    x: jax.Array, values: jax.Array, scales: jax.Array, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """`x @ dequantize(values, scales)` in float32.

    Args:
        x: `[M, K]` float activations.
        values: `[K, N]` int8 weights.
        scales: `[N]` float32 per-output-channel scales.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[M, N]`.
    """
    weight = dequantize_int8_per_channel(values, scales)  # [K, N]
    product = jnp.matmul(x.astype(jnp.float32), weight, precision=_HIGHEST)  # [M, N]
    return product.astype(out_dtype or x.dtype)


def int4_matmul_reference(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    zeros: jax.Array | None,
    group_size: int,
    *,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """`x @ dequantize(packed, scales, zeros)` in float32.

    Args:
        x: `[M, K]` float activations.
        packed: `[K // 2, N]` uint8, two int4 values per byte (see `pack_int4`).
        scales: `[K // group_size, N]` float32.
        zeros: `[K // group_size, N]` int8 zero points, or None for symmetric weights.
        group_size: Rows of K per scale group.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[M, N]`.
    """
    weight = dequantize_int4_grouped(packed, scales, zeros, group_size)  # [K, N]
    product = jnp.matmul(x.astype(jnp.float32), weight, precision=_HIGHEST)  # [M, N]
    return product.astype(out_dtype or x.dtype)


def w8a8_int32_product_reference(x_values: jax.Array, weight_values: jax.Array) -> jax.Array:
    """The exact int32 accumulator of W8A8: `[M, K]` int8 times `[K, N]` int8 as `[M, N]`."""
    return jax.lax.dot(x_values, weight_values, preferred_element_type=jnp.int32)  # [M, N]


def w8a8_rescale(
    accumulator: jax.Array, x_scales: jax.Array, weight_scales: jax.Array
) -> jax.Array:
    """`[M, N]` int32 accumulator times `[M]` token and `[N]` channel scales, as float32.

    The kernel applies these same operations in this same order to its accumulator
    tile, so a matching accumulator gives a bit-identical float32 result.
    """
    return (accumulator.astype(jnp.float32) * x_scales[:, None]) * weight_scales[None, :]


def w8a8_matmul_reference(
    x: jax.Array, values: jax.Array, scales: jax.Array, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """Quantizes `x` per token to int8, multiplies in int32, then rescales.

    Args:
        x: `[M, K]` float activations.
        values: `[K, N]` int8 weights.
        scales: `[N]` float32 per-output-channel weight scales.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[M, N]`.
    """
    x_values, x_scales = quantize_per_token_int8(x)  # [M, K], [M]
    accumulator = w8a8_int32_product_reference(x_values, values)  # [M, N]
    return w8a8_rescale(accumulator, x_scales, scales).astype(out_dtype or x.dtype)
