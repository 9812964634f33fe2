"""Readable float32 references for weight-quantized matmuls, and the quantizers they share.

Four formats, all with weights laid out `[I, O]` (input features by output features):

    int8   weight-only: int8 values, one float32 scale per output channel (column)
    int4   weight-only: int4 values packed two per byte along I, one float32 scale per
           group of `group_size` rows per column, optionally a zero point per group (int8,
           or float32 for offsets that are not whole steps)
    int8_grouped  weight-only: int8 values, one float32 scale per group of `group_size`
           rows per column (symmetric)
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
        w: `[I, O]` float weights.

    Returns:
        `(values, scales)`: `[I, O]` int8 in [-127, 127] and `[O]` float32, such that
        `values * scales` approximates `w` to within `scales / 2` per element.
    """
    w = w.astype(jnp.float32)  # [I, O]
    scales = _safe_scale(jnp.max(jnp.abs(w), axis=0) / INT8_MAX)  # [O]
    values = jnp.clip(jnp.round(w / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8)  # [I, O]
    return values, scales


def dequantize_int8_per_channel(values: jax.Array, scales: jax.Array) -> jax.Array:
    """`[I, O]` int8 values times `[O]` scales, as `[I, O]` float32."""
    return values.astype(jnp.float32) * scales[None, :]  # [I, O]


def pack_int4(values: jax.Array) -> jax.Array:
    """Packs signed int4 values two per byte along I (low nibble = even row).

    Args:
        values: `[I, O]` integers in [-8, 7]; I even.

    Returns:
        `[I // 2, O]` uint8.
    """
    if values.shape[0] % 2:
        raise ValueError(f"int4 packing needs an even number of rows, got shape {values.shape}")
    nibbles = (values.astype(jnp.int32) & 0xF).astype(jnp.uint8)  # [I, O] two's complement
    low, high = nibbles[0::2], nibbles[1::2]  # [I // 2, O] each
    return low | (high << 4)  # [I // 2, O]


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_int4`: `[I // 2, O]` uint8 to `[I, O]` int8 in [-8, 7]."""
    low = (packed & 0xF).astype(jnp.int32)  # [I // 2, O]
    high = (packed >> 4).astype(jnp.int32)  # [I // 2, O]
    # Sign extension of a 4-bit two's-complement number: flip the sign bit, subtract it.
    low, high = (low ^ 8) - 8, (high ^ 8) - 8
    interleaved = jnp.stack([low, high], axis=1)  # [I // 2, 2, O]
    return interleaved.reshape(-1, packed.shape[1]).astype(jnp.int8)  # [I, O]


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
        groups: `[C, group_size, O]` float weights: C groups of group_size rows (the reduced
            axis is 1).
        bits: Bit width, 2 to 4.
        symmetric: True: `scale = max|w| / (2^(b-1) - 1)`, no zero point. False: the
            group's [min, max] maps onto all `2^b` levels through a zero point.

    Returns:
        `(scales, zeros)`: `[C, O]` float32 and `[C, O]` int8 in the signed nibble domain
        (None when symmetric).
    """
    groups = groups.astype(jnp.float32)  # [C, group_size, O]
    lowest, highest = int4_levels(bits, symmetric)
    if symmetric:
        return _safe_scale(jnp.max(jnp.abs(groups), axis=1) / highest), None  # [C, O]
    low, high = jnp.min(groups, axis=1), jnp.max(groups, axis=1)  # [C, O] each
    scales = _safe_scale((high - low) / (highest - lowest))  # [C, O]
    # The zero point sits on the unsigned grid [0, 2^b - 1], then shifts by -8 like the values.
    unsigned_zeros = jnp.clip(jnp.round(-low / scales), 0, highest - lowest)  # [C, O]
    return scales, (unsigned_zeros + lowest).astype(jnp.int8)


def quantize_groups(
    groups: jax.Array, scales: jax.Array, zeros: jax.Array | None, bits: int
) -> jax.Array:
    """Rounds `[C, group_size, O]` weights onto the nibble grid of given `[C, O]` scales and zeros.

    Returns:
        `[C, group_size, O]` int8 values in `int4_levels(bits, zeros is None)`, such that
        `(values - zeros) * scales` is the nearest grid point to each weight (clipped).
    """
    lowest, highest = int4_levels(bits, zeros is None)
    steps = jnp.round(groups.astype(jnp.float32) / scales[:, None])  # [C, group_size, O]
    if zeros is not None:
        steps = steps + zeros.astype(jnp.float32)[:, None]
    return jnp.clip(steps, lowest, highest).astype(jnp.int8)  # [C, group_size, O]


def quantize_int4_grouped(
    w: jax.Array, group_size: int, *, symmetric: bool = True, bits: int = 4
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Group-wise int4 (or narrower) quantization along I, packed two values per byte.

    Args:
        w: `[I, O]` float weights; I a multiple of `group_size`.
        group_size: Rows sharing one scale (and zero point); even.
        symmetric: True: values in [-7, 7], no zero point. False: each group's [min, max]
            maps onto all 16 levels through a zero point.
        bits: 4, or 3 or 2 for a coarser grid in the same nibble storage (see `int4_levels`).

    Returns:
        `(packed, scales, zeros)`: `[I // 2, O]` uint8, `[C, O]` float32 and
        `[C, O]` int8 in [-8, 7] (None when symmetric). The dequantized
        weight, `(unpack_int4(packed) - zeros) * scales` per group, is within
        `scales / 2` of `w`.

    Raises:
        ValueError: I is not a multiple of `group_size`, `group_size` is odd, or `bits` is
            outside [2, 4].
    """
    k, n = w.shape
    if group_size <= 0 or group_size % 2 or k % group_size:
        raise ValueError(f"int4 group_size must be even and divide K; got K={k} "
                         f"(weight shape {w.shape}), group_size={group_size}")
    groups = w.astype(jnp.float32).reshape(k // group_size, group_size, n)  # [C, group_size, O]
    scales, zeros = grouped_quantization_parameters(groups, bits,
                                                    symmetric=symmetric)  # [C, O], [C, O] or None
    values = quantize_groups(groups, scales, zeros, bits)  # [C, group_size, O]
    packed = pack_int4(values.reshape(k, n))  # [I // 2, O]
    return packed, scales, zeros


def dequantize_grouped(
    values: jax.Array, scales: jax.Array, zeros: jax.Array | None, group_size: int
) -> jax.Array:
    """`[I, O]` integer values with `[C, O]` scales (and zero points) to `[I, O]` float32:
    `(value - zero) * scale` per group of `group_size` rows."""
    values = values.astype(jnp.float32)  # [I, O]
    k, n = values.shape
    groups = values.reshape(k // group_size, group_size, n)  # [C, group_size, O]
    if zeros is not None:
        groups = groups - zeros.astype(jnp.float32)[:, None]  # [C, group_size, O]
    return (groups * scales[:, None]).reshape(k, n)  # [I, O]


def dequantize_int4_grouped(
    packed: jax.Array, scales: jax.Array, zeros: jax.Array | None, group_size: int
) -> jax.Array:
    """`[I // 2, O]` packed int4 with `[C, O]` scales/zeros to `[I, O]` f32."""
    return dequantize_grouped(unpack_int4(packed), scales, zeros, group_size)  # [I, O]


def quantize_int8_grouped(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization with one scale per group of `group_size` rows and column.

    Args:
        w: `[I, O]` float weights; I a multiple of `group_size`.
        group_size: Rows sharing one scale.

    Returns:
        `(values, scales)`: `[I, O]` int8 in [-127, 127] and `[C, O]` float32.

    Raises:
        ValueError: I is not a multiple of `group_size`.
    """
    k, n = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"int8_grouped group_size must divide K; got K={k} "
                         f"(weight shape {w.shape}), group_size={group_size}")
    groups = w.astype(jnp.float32).reshape(k // group_size, group_size, n)  # [C, group_size, O]
    scales = _safe_scale(jnp.max(jnp.abs(groups), axis=1) / INT8_MAX)  # [C, O]
    steps = jnp.round(groups / scales[:, None])  # [C, group_size, O]
    values = jnp.clip(steps, -INT8_MAX, INT8_MAX)  # [C, group_size, O]
    return values.astype(jnp.int8).reshape(k, n), scales


def quantize_per_token_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization of activations with one scale per token (row).

    Args:
        x: `[T, I]` float activations.

    Returns:
        `(values, scales)`: `[T, I]` int8 in [-127, 127] and `[T]` float32.
    """
    x = x.astype(jnp.float32)  # [T, I]
    scales = _safe_scale(jnp.max(jnp.abs(x), axis=1) / INT8_MAX)  # [T]
    values = jnp.clip(jnp.round(x / scales[:, None]), -INT8_MAX, INT8_MAX)  # [T, I]
    return values.astype(jnp.int8), scales


def int8_matmul_reference(
    x: jax.Array, values: jax.Array, scales: jax.Array, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """`x @ dequantize(values, scales)` in float32.

    Args:
        x: `[T, I]` float activations.
        values: `[I, O]` int8 weights.
        scales: `[O]` float32 per-output-channel scales.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[T, O]`.
    """
    weight = dequantize_int8_per_channel(values, scales)  # [I, O]
    product = jnp.matmul(x.astype(jnp.float32), weight, precision=_HIGHEST)  # [T, O]
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
        x: `[T, I]` float activations.
        packed: `[I // 2, O]` uint8, two int4 values per byte (see `pack_int4`).
        scales: `[C, O]` float32.
        zeros: `[C, O]` int8 or float32 zero points, or None for symmetric weights.
        group_size: Rows of I per scale group.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[T, O]`.
    """
    weight = dequantize_int4_grouped(packed, scales, zeros, group_size)  # [I, O]
    product = jnp.matmul(x.astype(jnp.float32), weight, precision=_HIGHEST)  # [T, O]
    return product.astype(out_dtype or x.dtype)


def int8_grouped_matmul_reference(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array,
    group_size: int,
    *,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """`x @ dequantize_grouped(values, scales, None, group_size)` in float32.

    Args:
        x: `[T, I]` float activations.
        values: `[I, O]` int8 weights.
        scales: `[C, O]` float32.
        group_size: Rows of I per scale group.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[T, O]`.
    """
    weight = dequantize_grouped(values, scales, None, group_size)  # [I, O]
    product = jnp.matmul(x.astype(jnp.float32), weight, precision=_HIGHEST)  # [T, O]
    return product.astype(out_dtype or x.dtype)


def w8a8_int32_product_reference(x_values: jax.Array, weight_values: jax.Array) -> jax.Array:
    """The exact int32 accumulator of W8A8: `[T, I]` int8 times `[I, O]` int8 as `[T, O]`."""
    return jax.lax.dot(x_values, weight_values, preferred_element_type=jnp.int32)  # [T, O]


def w8a8_rescale(
    accumulator: jax.Array, x_scales: jax.Array, weight_scales: jax.Array
) -> jax.Array:
    """`[T, O]` int32 accumulator times `[T]` token and `[O]` channel scales, as float32.

    The kernel applies these same operations in this same order to its accumulator
    tile, so a matching accumulator gives a bit-identical float32 result.
    """
    return (accumulator.astype(jnp.float32) * x_scales[:, None]) * weight_scales[None, :]


def w8a8_matmul_reference(
    x: jax.Array, values: jax.Array, scales: jax.Array, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """Quantizes `x` per token to int8, multiplies in int32, then rescales.

    Args:
        x: `[T, I]` float activations.
        values: `[I, O]` int8 weights.
        scales: `[O]` float32 per-output-channel weight scales.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[T, O]`.
    """
    x_values, x_scales = quantize_per_token_int8(x)  # [T, I], [T]
    accumulator = w8a8_int32_product_reference(x_values, values)  # [T, O]
    return w8a8_rescale(accumulator, x_scales, scales).astype(out_dtype or x.dtype)


ACTIVATION_BLOCK = 32  # features per int8 activation scale (llama.cpp's Q8 block)


def quantize_activations_per_block(x: jax.Array, block: int = ACTIVATION_BLOCK
                                   ) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization of activations per row and block of `block` features.

    Args:
        x: `[T, I]` float activations; I a multiple of `block`.
        block: Features sharing one scale.

    Returns:
        `(levels, scales)`: `[T, I]` int8 `round(x / d)` and `[T, I // block]` float32
        `d = max |x| / 127` (0 for a block of zeros, whose levels are 0).
    """
    t, k = x.shape
    blocks = x.astype(jnp.float32).reshape(t, k // block, block)  # [T, I / block, block]
    scales = jnp.max(jnp.abs(blocks), axis=-1) / INT8_MAX  # [T, I / block]
    safe = jnp.where(scales > 0, scales, 1.0)[..., None]  # [T, I / block, 1]
    levels = jnp.where(scales[..., None] > 0, jnp.round(blocks / safe),
                       0.0)  # [T, I / block, block]
    levels = jnp.clip(levels, -INT8_MAX, INT8_MAX).astype(jnp.int8).reshape(t, k)  # [T, I]
    return levels, scales


def int8_activation_matmul(x: jax.Array, dequantized_weight: jax.Array,
                           block: int = ACTIVATION_BLOCK) -> jax.Array:
    """The product the CPU kernel computes with int8 activations: `x` quantized per row and
    block (`quantize_activations_per_block`), dequantized, times the float32 `[I, O]` weight.

    Returns:
        `[T, O]` float32.
    """
    levels, scales = quantize_activations_per_block(x, block)  # [T, I], [T, I / block]
    t, k = levels.shape
    rounded = (levels.astype(jnp.float32).reshape(t, k // block, block)
               * scales[..., None]).reshape(t, k)  # [T, I]
    return jnp.matmul(rounded, dequantized_weight, precision=_HIGHEST)  # [T, O]
