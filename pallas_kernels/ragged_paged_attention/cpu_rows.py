"""KV rows written and read in the pool's own buffer on XLA:CPU: `cpu_rows.cc` through XLA FFI.

XLA:CPU has no float8 scatter or gather: it widened the whole pool to float16 around each, and
the way round that, a uint8 `bitcast_convert_type` of the pool, is a whole-pool copy as well
(three per layer: float8 KV decoded at 0.35-0.41x float32 KV at batch 64,
`benchmarks/results/kv_dtypes_decode.md`). The C++ handlers move rows as bytes, of any dtype:
`write_rows` updates the pool in place (the call's output aliases it) and `read_rows` copies
out only the rows asked for. Their results equal the `.at[].set` and gathers they replace
(`tests/pallas_kernels/test_cpu_rows.py`). Callers choose them with `cpu_build.on_cpu`, so a
TPU program compiled on a CPU host keeps XLA's ops.

Built on first use by `pallas_kernels.cpu_build`; where it cannot be, `supports` is False and
the callers keep XLA's ops.
"""

from __future__ import annotations

import functools
import math
import pathlib

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_rows.cc")
_switch = cpu_build.KernelSwitch()
# Within `with disabled():` (while tracing), `supports` is False: XLA's ops run instead.
disabled = _switch.disabled


@functools.cache
def available() -> bool:
    """Whether the handlers are built and registered (False, with one warning, if not)."""
    return cpu_build.kernel_available(SOURCE, ("WriteRows", "ReadRows"),
                                      kernel="KV rows", fallback="XLA's scatter and gather")


def supports(pool: jax.Array) -> bool:
    """Whether the handlers move `pool`'s rows on this backend (one device, XLA:CPU)."""
    return (not _switch.off and jax.default_backend() == "cpu" and cpu_build.single_device()
            and available())


def _layer(layer: jax.Array | int) -> jax.Array:
    """The layer as the handlers take it; registers them first (a call before `supports`)."""
    if not available():
        raise RuntimeError("the CPU KV row handlers are not built (see the warning above)")
    return jnp.asarray(layer, jnp.int32).reshape(1)  # [1]


def _read_index(pool: jax.Array, index: jax.Array, row_rank: int | None
                ) -> tuple[jax.Array, int, tuple[int, ...]]:
    """The indices with negative ones counted from the end (numpy's indexing), the row rank,
    and the row shape."""
    row_rank = pool.ndim - 2 if row_rank is None else row_rank
    num_rows = math.prod(pool.shape[1:pool.ndim - row_rank])
    index = jnp.asarray(index, jnp.int32)
    index = jnp.where(index < 0, index + num_rows, index)  # [...]
    return index, row_rank, pool.shape[pool.ndim - row_rank:]


def write_rows(pool: jax.Array, rows: jax.Array, slots: jax.Array,
               layer: jax.Array | int) -> jax.Array:
    """`pool.at[layer, slots].set(rows)` in place, over the pool's rows of `rows.shape[1:]`.

    Pass the pool in its own shape: XLA aliases the call's output to a loop-carried pool, but
    copied the whole pool to alias it to a reshape of one.

    Args:
        pool: `[L, N..., R...]` pool; the rows are its trailing `rows.ndim - 1` axes (the rows
            of `[L, P, Z, 2K, H]` with `[T, 2K, H]` rows are its P*Z token slots).
        rows: `[T, R...]` rows (cast to the pool's dtype).
        slots: `[T]` int32 row numbers within the layer; one outside `[0, N)` is dropped.
        layer: int32 scalar, the layer written (clamped into range).

    Returns:
        The pool, shaped as given, with the rows written (its own buffer where XLA can donate it).
    """
    call = jax.ffi.ffi_call("jaxinfer_WriteRows", jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0})
    return call(pool, rows.astype(pool.dtype), slots.astype(jnp.int32), _layer(layer),
                row_rank=rows.ndim - 1)


def read_rows(pool: jax.Array, layer: jax.Array | int, index: jax.Array,
              row_rank: int | None = None) -> jax.Array:
    """`pool[layer, index]` over the pool's rows (indices clamped into range).

    Args:
        pool: `[L, N..., R...]` pool.
        layer: int32 scalar, the layer read (clamped into range).
        index: `[...]` int32 row numbers within the layer (negative ones count from the end,
            as numpy's indexing does).
        row_rank: The trailing axes that make a row (None: all but the first two, so
            `[L, N, R...]` rows of the second axis).

    Returns:
        `[..., R...]` the rows, of the pool's dtype.
    """
    index, row_rank, row_shape = _read_index(pool, index, row_rank)
    call = jax.ffi.ffi_call("jaxinfer_ReadRows",
                            jax.ShapeDtypeStruct((*index.shape, *row_shape), pool.dtype))
    return call(pool, index, _layer(layer), row_rank=row_rank)
