"""FP8 (e4m3) weights with one float32 scale per output channel: quantize, dequantize, reference.

The "fp8" weight format (vLLM's `--quantization fp8` for weights) stores each `[I, O]`
weight as `jnp.float8_e4m3fn` values and a float32 scale per output column:

    scale[o] = max_i |w[i, o]| / 448          (448: the largest finite e4m3fn value)
    values   = cast_e4m3fn(clip(w / scale, -448, 448))

The cast rounds to the nearest e4m3 value (ties to even), so this is round to nearest on a
floating-point grid rather than an integer one. e4m3 keeps 3 mantissa bits: an element whose
scaled magnitude is a normal e4m3 number (at least 2**-6) is off by at most 2**-4 of itself,
and a smaller one by at most half the subnormal step, 2**-10, times the scale. One byte per
weight plus 4 bytes per column: `1 + 4 / I` bytes per parameter, as int8, but the grid is
relative, so small weights in a column with one large weight keep their precision.

e4m3fn has no infinities and its one NaN pattern is never produced here (values are clipped
to +-448 before the cast). Upcasting e4m3 to bfloat16 or float32 is exact (bf16 has 8
significant bits and a wider exponent range), which the kernel (`fp8_kernel.py`) relies on.

GPTQ cannot target the format: its per-column rounding works on an integer grid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["FP8_DTYPE", "FP8_MAX", "dequantize_fp8_per_channel", "fp8_matmul_reference",
           "quantize_fp8_per_channel"]

FP8_DTYPE = jnp.float8_e4m3fn
# The largest finite e4m3fn value: 1.75 * 2**8.
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)
# Float32 at full precision: on TPU the default precision would round the operands to
# bfloat16 and the reference would stop being a reference.
_HIGHEST = jax.lax.Precision.HIGHEST


def quantize_fp8_per_channel(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Round-to-nearest e4m3 quantization with one scale per output channel.

    Args:
        w: `[I, O]` float weights.

    Returns:
        `(values, scales)`: `[I, O]` float8_e4m3fn and `[O]` float32, such that
        `values * scales` approximates `w` within `2**-4 |w|` per element, or
        `2**-10 * scale` where `|w| / scale` is below e4m3's smallest normal, 2**-6.
    """
    w = w.astype(jnp.float32)  # [I, O]
    maximum = jnp.max(jnp.abs(w), axis=0) / FP8_MAX  # [O]
    # An all-zero column would give 0 / 0 = NaN; any nonzero scale stores it as exact zeros.
    scales = jnp.where(maximum > 0, maximum, 1.0)  # [O]
    # The clip only guards against w / scale rounding a hair above 448 in float32.
    values = jnp.clip(w / scales, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)  # [I, O]
    return values, scales


def dequantize_fp8_per_channel(values: jax.Array, scales: jax.Array) -> jax.Array:
    """The float32 `[I, O]` weight of `[I, O]` e4m3 values and `[O]` scales."""
    return values.astype(jnp.float32) * scales.astype(jnp.float32)  # [I, O]


def fp8_matmul_reference(
    x: jax.Array, values: jax.Array, scales: jax.Array, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """`x @ dequantize(values, scales)`: the readable reference, in float32.

    The values are upcast to float32 (exact), multiplied, and each output column is scaled
    once, as the kernel does; the XLA path runs this.

    Args:
        x: `[T, I]` float activations.
        values: `[I, O]` float8_e4m3fn weights.
        scales: `[O]` float32 per-output-channel scales.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[T, O]`.
    """
    product = jnp.matmul(x.astype(jnp.float32), values.astype(jnp.float32),
                         precision=_HIGHEST)  # [T, O]
    return (product * scales.astype(jnp.float32)).astype(out_dtype or x.dtype)  # [T, O]
