"""The CPU kernel of float matmuls at decode sizes: `cpu_matmul.cc`, called through XLA FFI.

XLA:CPU multiplies a few rows by a weight matrix at 20-60% of the rate it reaches on large
products (a `[1, 512] x [512, 1536]` product at ~7 GFLOP/s, `[64, 512] x [512, 1536]` at ~105,
against ~265 at `[1024, 512] x [512, 1536]` on the same core), and a decode step is made of
exactly such products, one row per running sequence. The C++ kernel streams the weight once
per step at the machine's read bandwidth and runs 1.8-4x XLA's rate at those sizes
(`benchmarks/results/kernels.md`). For many rows (prefill buckets) XLA's own tiling is as fast
or faster, so `supports` sends only products of at most `max_rows()` rows here.

Weights may be float32 or bfloat16 (activations are float32): a bfloat16 weight is read as
stored and widened in registers, half the bytes of a float32 one, where XLA:CPU's bfloat16
dot converts element by element and ran a bfloat16 model 20-25x slower than float32.

The source is built on first use by `pallas_kernels.cpu_build`. Its paths: AVX-512 (float32
weights, up to `MAX_ROWS` rows) and AVX2 + FMA (bfloat16 weights everywhere, float32 ones
without AVX-512, up to `AVX2_MAX_ROWS`: a streaming walk, then float32 panels). Where it
cannot be built, or the CPU has neither, `available()` is False and XLA's dot runs.
`JAXINFER_CPU_KERNELS=0` turns it off; `disabled()` does so while tracing.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")
_TARGET = "DenseMatmulF32"
# Rows up to which the AVX-512 path beats XLA:CPU's dot (measured in `benchmarks/kernels.py`):
# for a [K, N] weight it leads by 1.8-2x up to 256 rows and trails at 1024; for an [N, K]
# weight (a tied LM head, dotted row by row) it leads only up to ~32 rows.
MAX_ROWS = 256
MAX_ROWS_TRANSPOSED = 32
# Rows up to which the AVX2 path runs: its streaming walk up to 16 rows, then float32 panels
# of the weight under a 6 x 16 register tile (`cpu_panel.h`), 1.1-2.5x XLA's dot from 17 to
# 128 rows of SmolLM2's [K, N] layers in float32 and bfloat16 (`benchmarks/
# cpu_kernel_rows.py`). Longer products keep XLA's dot, after a bfloat16 layer is widened.
AVX2_MAX_ROWS = 128
# A float32 [N, K] weight (a tied LM head) is transposed into each panel, which ran at
# 0.8-1.0x XLA's dot: past the streaming walk's 16 rows it keeps XLA's. A bfloat16 one takes
# the panels (3-4x XLA's dot, which widens the whole table first).
AVX2_MAX_ROWS_TRANSPOSED_FLOAT32 = 16
# `JaxinferMatmulVectorized` of a library with both paths (1: AVX2 only).
_AVX512_AND_AVX2 = 2
# Weight dtypes the kernel reads.
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_switch = cpu_build.KernelSwitch()
# Within `with disabled():` (while tracing), `supports` is False: XLA's dot runs instead.
disabled = _switch.disabled


@functools.cache
def _level() -> int:
    """0: unavailable; 1: the AVX2 path; 2: AVX-512 and AVX2 (with one warning if the
    kernel cannot be built, or 0 with `JAXINFER_CPU_KERNELS=0`)."""
    return cpu_build.kernel_level(SOURCE, [_TARGET], kernel="matmul", fallback="XLA's dot",
                                  vectorized="JaxinferMatmulVectorized")


def available() -> bool:
    """Whether the kernel is built, registered and vectorized for this CPU."""
    return _level() > 0


def max_rows(weight_dtype: jnp.dtype, *, transposed: bool = False) -> int:
    """The most rows the kernel takes for a weight of `weight_dtype` on this CPU (0: none)."""
    level = _level()
    if level == 0 or jnp.dtype(weight_dtype) not in WEIGHT_DTYPES:
        return 0
    if level == _AVX512_AND_AVX2 and jnp.dtype(weight_dtype) == jnp.float32:
        return MAX_ROWS_TRANSPOSED if transposed else MAX_ROWS
    if transposed and jnp.dtype(weight_dtype) == jnp.float32:
        return AVX2_MAX_ROWS_TRANSPOSED_FLOAT32
    return AVX2_MAX_ROWS


def supports(x: jax.Array, weight: jax.Array, *, transposed: bool = False) -> bool:
    """Whether the kernel takes `x [..., K] @ weight` on this backend.

    Args:
        x: `[..., K]` float32 activations.
        weight: `[K, N]` (`[N, K]` with `transposed`), or `[L, K, N]` / `[L, N, K]` stacked;
            float32 or bfloat16.
        transposed: The weight is `[N, K]`.
    """
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    # Only while tracing (inside jit): run eagerly, each call would compile its own small
    # programs (reshapes, the custom call) per shape, where XLA's dot is one cached op.
    traced = isinstance(x, jax.core.Tracer) or isinstance(weight, jax.core.Tracer)
    return (traced and not _switch.off and jax.default_backend() == "cpu"
            and weight.ndim in (2, 3) and x.dtype == jnp.float32
            and cpu_build.single_device()
            and 0 < rows <= max_rows(weight.dtype, transposed=transposed))


def _call(x: jax.Array, stack: jax.Array, layer: jax.Array, transposed: bool) -> jax.Array:
    if not available():  # also registers the FFI target on first use
        raise RuntimeError("the CPU matmul kernel is unavailable on this machine")
    rows = x.shape[0]  # x: [M, K]
    columns = stack.shape[1] if transposed else stack.shape[2]
    call = jax.ffi.ffi_call(f"jaxinfer_{_TARGET}",
                            jax.ShapeDtypeStruct((rows, columns), jnp.float32),
                            vmap_method="sequential")
    return call(x, stack, layer.reshape(1), transposed=transposed,
                num_threads=np.int32(cpu_build.num_threads()))  # [M, N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x: jax.Array, stack: jax.Array, layer: jax.Array, transposed: bool) -> jax.Array:
    return _call(x, stack, layer, transposed)  # [M, N]


def _matmul_forward(x: jax.Array, stack: jax.Array, layer: jax.Array, transposed: bool
                    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    return _call(x, stack, layer, transposed), (x, stack, layer)


def _matmul_backward(transposed: bool, saved: tuple[jax.Array, jax.Array, jax.Array],
                     grad: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    # Gradients take XLA's dot: training runs at prefill sizes, where it is as fast.
    x, stack, layer = saved  # [M, K], [L, K, N] or [L, N, K], []
    matrix = jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False).astype(
        x.dtype)  # [K, N] or [N, K]
    kn = matrix.T if transposed else matrix  # [K, N]
    grad_x = grad @ kn.T  # [M, K]
    grad_kn = x.T @ grad  # [K, N]
    grad_matrix = grad_kn.T if transposed else grad_kn  # [K, N] or [N, K]
    grad_stack = jax.lax.dynamic_update_index_in_dim(
        jnp.zeros_like(stack), grad_matrix.astype(stack.dtype), layer,
        axis=0)  # [L, K, N] or [L, N, K]
    return grad_x, grad_stack, None


_matmul.defvjp(_matmul_forward, _matmul_backward)


def matmul(x: jax.Array, weight: jax.Array, *, layer: jax.Array | int | None = None,
           transposed: bool = False) -> jax.Array:
    """`x @ weight` (or `x @ weight.T`) through the kernel; check `supports` first.

    Differentiable: the backward pass uses XLA's dot.

    Args:
        x: `[..., K]` float32 activations.
        weight: `[K, N]` float32 or bfloat16 (`[N, K]` with `transposed`), or with `layer`
            a stack `[L, K, N]` (`[L, N, K]`) of which `weight[layer]` is read in place.
        layer: Index into a stacked `weight`; None for a single matrix.
        transposed: The weight is `[N, K]`.

    Returns:
        `[..., N]` float32.
    """
    stack = weight if layer is not None else weight[None]  # [L, K, N] or [L, N, K]
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)  # []
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    out = _matmul(flat, stack, index, transposed)  # [M, N]
    return out.reshape(*x.shape[:-1], out.shape[-1])  # [..., N]
