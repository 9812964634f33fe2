"""A step's KIVI writes on XLA:CPU, only the pages it completes: `cpu_kivi_write.cc` via XLA FFI.

`kivi.write_to_kivi_pages` in XLA has room for the most pages a step could complete, one per
sequence at decode, and quantizes that many pages' rows every layer of every step: at 64
sequences, 64 pages where about 4 complete (`benchmarks/results/kv_dtypes_decode.md`: KIVI
int4 decoded at ~0.7x float32 KV). The C++ handler quantizes just the completed pages and
writes every array of the pool in place; its codes and scales are those of the XLA path
(`tests/pallas_kernels/test_ragged_paged_attention_kivi.py`).

Built on first use by `pallas_kernels.cpu_build`; where it cannot be, `supports` is False and
the XLA path runs.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_kivi_write.cc")
_switch = cpu_build.KernelSwitch()
# Within `with disabled():` (while tracing), `supports` is False: the XLA path runs.
disabled = _switch.disabled


@functools.cache
def available() -> bool:
    """Whether the handler is built and registered (False, with one warning, if not)."""
    return cpu_build.kernel_available(SOURCE, ("KiviWrite",), kernel="KIVI write",
                                      fallback="the XLA write")


def supports(page_size: int) -> bool:
    """Whether the handler writes this pool's pages on this backend (one device, XLA:CPU)."""
    return (not _switch.off and jax.default_backend() == "cpu" and page_size <= 64
            and cpu_build.single_device() and available())


def write(pool: tuple[jax.Array, ...], rows: jax.Array, slot_mapping: jax.Array,
          position: jax.Array, context: jax.Array, kv_len: jax.Array, seat: jax.Array,
          layer: jax.Array | int) -> tuple[jax.Array, ...]:
    """The step's writes into one layer of a KIVI pool, in place.

    Args:
        pool: `(pages [L, P, Z, 2K, H*bits/8] uint8, key_scales [L, P, K, H], key_zeros,
            value_scales [L, P, Z, K, H/g], value_zeros (float16), residual [L, R, Z, 2K, H]
            float32)`.
        rows: `[T, 2K, H]` float32 keys and values of the step's tokens, interleaved.
        slot_mapping: `[T]` flat slot `page * Z + row`; negative: a padding token.
        position: `[T]` each token's position.
        context: `[T]` its sequence's keys before the step.
        kv_len: `[T]` its sequence's keys after the step.
        seat: `[T]` its sequence's residual seat.
        layer: The layer written.

    Returns:
        The six arrays of `pool`, written.
    """
    call = jax.ffi.ffi_call("jaxinfer_KiviWrite",
                            tuple(jax.ShapeDtypeStruct(part.shape, part.dtype) for part in pool),
                            input_output_aliases={index: index for index in range(6)})
    tokens = [jnp.asarray(part, jnp.int32) for part in (slot_mapping, position, context, kv_len,
                                                        seat)]
    return call(*pool, rows.astype(jnp.float32), *tokens,
                jnp.asarray(layer, jnp.int32).reshape(1))
