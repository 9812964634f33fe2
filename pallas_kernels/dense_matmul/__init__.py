"""Dense (float) matmul: `x @ weight` for a linear layer, through the fastest path here.

On XLA:CPU (AVX2 or AVX-512), products of few rows (decode steps) take the C++ kernel
(`cpu.py`), which also reads bfloat16 weights as stored under float32 activations; everywhere
else, and for many rows, XLA's `dot_general` runs, which is also the reference the kernel is
tested against. On TPU and GPU XLA's dot is the fast path already.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.dense_matmul import cpu

__all__ = ["cpu", "dense_matmul", "dense_matmul_reference"]


def dense_matmul_reference(x: jax.Array, weight: jax.Array, *, transposed: bool = False,
                           out_dtype: jnp.dtype | None = None) -> jax.Array:
    """`x [..., K] @ weight` with XLA's dot.

    Args:
        x: `[..., K]` activations.
        weight: `[K, N]`, or `[N, K]` with `transposed`; in `x`'s dtype.
        transposed: The weight is `[N, K]`.
        out_dtype: Accumulate and return in this dtype; default `x`'s.
    """
    contracted = 1 if transposed else 0
    return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (contracted,)), ((), ())),
                               preferred_element_type=out_dtype)  # [..., N]


def dense_matmul(x: jax.Array, weight: jax.Array, *, layer: jax.Array | int | None = None,
                 transposed: bool = False, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """`x [..., K] @ weight`, by the CPU kernel where it is faster, else XLA's dot.

    Args:
        x: `[..., K]` activations.
        weight: `[K, N]` (`[N, K]` with `transposed`); with `layer`, a stack `[L, K, N]`
            (`[L, N, K]`) of which `weight[layer]` is multiplied. A scan over layers passes
            the whole stack so that the kernel reads the layer in place (XLA:CPU would copy
            the slice out before its dot). A weight of another dtype than `x` (bfloat16
            parameters under float32 compute) is read as stored by the CPU kernel, else
            cast to `x`'s dtype after the layer is sliced (one layer, not the stack).
        layer: Index into a stacked `weight`, or None.
        transposed: The weight is `[N, K]`.
        out_dtype: Accumulate and return in this dtype; default `x`'s.

    Returns:
        `[..., N]` in `out_dtype` (or `x`'s dtype).
    """
    if out_dtype in (None, jnp.float32) and cpu.supports(x, weight, transposed=transposed):
        return cpu.matmul(x, weight, layer=layer, transposed=transposed)  # [..., N]
    if layer is not None:
        weight = jax.lax.dynamic_index_in_dim(weight, layer, keepdims=False)  # [K, N]
    return dense_matmul_reference(x, weight.astype(x.dtype), transposed=transposed,
                                  out_dtype=out_dtype)
