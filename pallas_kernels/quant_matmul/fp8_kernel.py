"""Pallas TPU kernel for fp8 (e4m3) weights with per-output-channel scales (`fp8.py`).

The grid and accumulation are the int8 kernel's (`kernel.per_channel_call`): `(T' // block_m,
O // block_n, I // block_k)`, the two output axes "parallel", I a reduction into a float32
VMEM scratch; this module holds the tile's multiply.
Each step reads a `[block_k, block_n]` tile of e4m3 values (one byte per weight, the HBM
traffic the format exists to halve) and upcasts it in VMEM; the scale is constant along I,
so it multiplies the accumulator once, on the last step.

The dot's operand dtype follows the activations: e4m3 upcasts exactly to bfloat16, and the
product of two bf16 numbers is exact in float32, so bf16 activations take a single-pass bf16
dot with float32 sums and still agree with the float32 reference to summation rounding;
float32 activations take a float32 dot at full precision. The weights are never fed to the
MXU as fp8: only v6e and later multiply fp8 natively, and the activations are not fp8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quant_matmul import fp8, kernel


def _fp8_kernel(x_ref, values_ref, scales_ref, out_ref, accumulator_ref):
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _zero():
        accumulator_ref[...] = jnp.zeros_like(accumulator_ref)

    x = x_ref[...]  # [block_m, block_k] bf16 or f32
    # Exact in either dtype (see the module docstring).
    weight = values_ref[...].astype(x.dtype)  # [block_k, block_n]
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    accumulator_ref[...] += jnp.dot(x, weight, precision=precision,
                                    preferred_element_type=jnp.float32)  # [block_m, block_n]

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _write():
        out_ref[...] = (accumulator_ref[...] * scales_ref[...]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "out_dtype",
                                             "interpret"))
def fp8_matmul(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    out_dtype: jnp.dtype | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`x @ (values * scales)` with e4m3 weights and per-output-channel scales.

    Args:
        x: `[T, I]` float32 or bfloat16 activations (others are computed in float32).
        values: `[I, O]` float8_e4m3fn weights.
        scales: `[O]` float32 per-output-channel scales.
        block_m, block_n, block_k: Block sizes; unset ones come from `tuning.py`.
        out_dtype: Result dtype; defaults to the dtype of `x`.
        interpret: `pallas_call`'s interpret argument.

    Returns:
        `[T, O]`.

    Raises:
        ValueError: Mismatched shapes or dtypes, or I / O not multiples of block_k / block_n.
    """
    k, n = values.shape
    if values.dtype != fp8.FP8_DTYPE:
        raise ValueError(f"fp8 matmul: values must be {jnp.dtype(fp8.FP8_DTYPE).name}, "
                         f"got {values.dtype}")
    if x.ndim != 2 or x.shape[1] != k or scales.shape != (n,):
        raise ValueError(f"fp8 matmul: x {x.shape} and scales {scales.shape} do not fit a "
                         f"[{k}, {n}] weight (expected [M, {k}] and [{n}])")
    out_dtype = out_dtype or x.dtype
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        x = x.astype(jnp.float32)
    return kernel.per_channel_call(_fp8_kernel, "fp8", x, values, scales,
                                   (block_m, block_n, block_k), out_dtype, interpret)
