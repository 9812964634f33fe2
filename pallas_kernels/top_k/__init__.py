"""The k largest entries of each row, and the argmax: a C++ scan on XLA:CPU, `jax.lax.top_k`
elsewhere.

XLA:CPU sorts each row whole for `lax.top_k` (~0.4 ms over a 49152-token vocabulary, in a
~10 ms batch-1 decode step of SmolLM2-135M) and computes `argmax` as a variadic reduce
(~0.25 ms). `cpu_top_k.cc` scans a row once, eight entries at a time, against the k-th largest
so far. Results equal `jax.lax.top_k`'s: IEEE total order, ties to the lower index
(`tests/pallas_kernels/test_top_k.py`).

Built on first use by `pallas_kernels.cpu_build`; where it cannot be, or off the CPU (chosen
at lowering, `cpu_build.on_cpu`), `jax.lax.top_k` runs.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_top_k.cc")
_switch = cpu_build.KernelSwitch()
# Within `with disabled():` (while tracing), `jax.lax.top_k` runs instead.
disabled = _switch.disabled


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (False, with one warning, if not)."""
    return cpu_build.kernel_available(SOURCE, ["TopK"], kernel="top-k",
                                      fallback="jax.lax.top_k")


def _supports(x: jax.Array) -> bool:
    return (not _switch.off and x.dtype == jnp.float32 and x.ndim >= 1 and x.size > 0
            and cpu_build.single_device() and available())


def _kernel(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    rows = x.reshape(-1, x.shape[-1])  # [B, V]
    call = jax.ffi.ffi_call("jaxinfer_TopK",
                            (jax.ShapeDtypeStruct((rows.shape[0], k), jnp.float32),
                             jax.ShapeDtypeStruct((rows.shape[0], k), jnp.int32)),
                            vmap_method="sequential")
    values, indices = call(rows, k=np.int64(k),
                           num_threads=np.int32(cpu_build.num_threads()))  # [B, k], [B, k]
    return (values.reshape(*x.shape[:-1], k),
            indices.reshape(*x.shape[:-1], k))  # [..., k], [..., k]


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)`: the `k` largest entries of each row of `x [..., V]` and their
    indices, `([..., k], [..., k] int32)`, in descending order (ties: lower index first)."""
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"k={k} must be in [1, {x.shape[-1]}] (the last axis of x)")
    return cpu_build.on_cpu(lambda: _kernel(x, k), lambda: tuple(jax.lax.top_k(x, k)),
                            supported=_supports(x))


def argmax(x: jax.Array) -> jax.Array:
    """`[...]` int32: the index of each row's largest entry of `x [..., V]`, the first where
    several are equal (`jnp.argmax` over the last axis, for rows without NaN)."""
    return cpu_build.on_cpu(lambda: _kernel(x, 1)[1][..., 0],
                            lambda: jnp.argmax(x, axis=-1).astype(jnp.int32),
                            supported=_supports(x))
