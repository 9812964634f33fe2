"""The CPU kernel of the decode walk: `cpu_decode.cc`, built on first use, called through XLA FFI.

On XLA:CPU the decode part of ragged paged attention (each decoding sequence's one query
against the keys already in its pages) is a loop of small gathers and einsums, and each loop
iteration costs ~25 XLA operations of a few microseconds each, so it ran at 10-30% of the
machine's bandwidth (`benchmarks/results/kernels.md`). The C++ kernel reads each key and value
once, straight from its page, and keeps the online-softmax statistics in registers. It returns
exactly what `xla._decode_context_stats` returns, so `xla.py` uses it in that one place and
merges the statistics with the step's own keys as before.

Every pool dtype is read in its own bytes: float32, bfloat16, int8 and both float8 kinds (with
their per-row scales) are widened a row at a time in registers, and a KIVI pool's int4 / int2
codes are dequantized a page at a time (with its key channel and value group scales) into a
buffer the page update reads while it is in cache; a sequence's partial last page comes from
its residual seat.

The source is built on first use by `pallas_kernels.cpu_build` (the system's C++ compiler,
cached per source, jaxlib and CPU). Where no compiler works, `available()` is False (with one
warning) and the XLA loop runs instead. `JAXINFER_CPU_KERNELS=0` turns the kernel off.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build
from pallas_kernels.ragged_paged_attention import kivi

SOURCE = pathlib.Path(__file__).with_name("cpu_decode.cc")
_TARGETS = {"float32": "DecodeAttentionF32", "bfloat16": "DecodeAttentionBF16",
            "int8": "DecodeAttentionS8", "float8_e4m3fn": "DecodeAttentionF8E4M3",
            "float8_e5m2": "DecodeAttentionF8E5M2"}
_KIVI_TARGET = "DecodeAttentionKivi"
_MAX_PAGE_SIZE = 64  # the kernel keeps one page of scores on the stack
_MAX_GROUP = 16  # and of each of up to 16 query heads per KV head
_switch = cpu_build.KernelSwitch()
# Within `with disabled():` (while tracing), `supports` is False: the XLA loop runs instead.
disabled = _switch.disabled


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (False, with one warning, if it cannot be,
    or with `JAXINFER_CPU_KERNELS=0`)."""
    return cpu_build.kernel_available(SOURCE, [*_TARGETS.values(), _KIVI_TARGET],
                                      kernel="decode-attention",
                                      fallback="the XLA loop")


def supports(kv_pages: jax.Array, group: int, kivi_pool: bool = False) -> bool:
    """Whether the kernel takes this pool (dtype, page size) and GQA group on this backend;
    `kivi_pool`: the pool is a KIVI pool's packed pages (`kivi.py`)."""
    return (not _switch.off and jax.default_backend() == "cpu"
            and (kivi_pool or str(kv_pages.dtype) in _TARGETS)
            and kv_pages.shape[-3] <= _MAX_PAGE_SIZE and group <= _MAX_GROUP and available())


def decode_context_stats(kv_pages: jax.Array, kv_scales: jax.Array | kivi.KiviPool | None,
                         layer: jax.Array | int, page_indices: jax.Array,
                         queries: jax.Array, context: jax.Array, position: jax.Array,
                         window: int, soft_cap: float | None,
                         residual_slots: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The softmax statistics of each decode query over its sequence's earlier keys.

    Args:
        kv_pages: `[L, P, Z, 2K, H]` the stacked pool (float32, bfloat16, int8 or float8), or
            a KIVI pool's packed pages `[L, P, Z, 2K, H * bits / 8]`.
        kv_scales: `[L, P, Z, 2K]` float32 scales of an 8-bit pool, a KIVI pool's `KiviPool`,
            or None.
        layer: The layer to read.
        page_indices: `[Q, pages_per_seq]` page tables.
        queries: `[Q, K, G, H]` each sequence's (scaled) query.
        context: `[Q]` keys before this step (0: the row is not decoding).
        position: `[Q]` the query's position.
        window: Keys visible per query (itself included).
        soft_cap: Logit soft-cap, or None.
        residual_slots: `[Q]` each sequence's residual seat (a KIVI pool's only).

    Returns:
        Running max `[Q, K, G]`, denominator `[Q, K, G]`, weighted values `[Q, K, G, H]`
        (max -inf and zeros for a row without keys), as `xla._decode_context_stats`.
    """
    num_seqs, num_kv_heads, group, head_dim = queries.shape
    rows = (num_seqs, num_kv_heads, group)
    outputs = (jax.ShapeDtypeStruct(rows, jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
               jax.ShapeDtypeStruct((*rows, head_dim), jnp.float32))
    common = (page_indices.astype(jnp.int32), queries.astype(jnp.float32),
              context.astype(jnp.int32), position.astype(jnp.int32))
    attributes = dict(window=np.int32(min(window, np.iinfo(np.int32).max)),
                      soft_cap=np.float32(soft_cap or 0.0),
                      num_threads=np.int32(cpu_build.num_threads()))
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if isinstance(kv_scales, kivi.KiviPool):
        call = jax.ffi.ffi_call(f"jaxinfer_{_KIVI_TARGET}", outputs)
        return call(kv_pages, kv_scales.key_scales, kv_scales.key_zeros,
                    kv_scales.value_scales, kv_scales.value_zeros, kv_scales.residual,
                    jnp.asarray(residual_slots, jnp.int32), layer, *common, **attributes)
    quantized = kv_scales is not None
    scales = kv_scales if quantized else jnp.zeros((1,), jnp.float32)  # [L, P, Z, 2K] or [1]
    target = _TARGETS[str(kv_pages.dtype)]
    # A float8 pool goes as itself: a uint8 bitcast of it was a copy of the whole pool (three
    # per layer: 0.35x float32 KV's decode at batch 64).
    call = jax.ffi.ffi_call(f"jaxinfer_{target}", outputs)
    return call(kv_pages, scales, layer, *common, quantized=quantized, **attributes)
