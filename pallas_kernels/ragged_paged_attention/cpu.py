"""The CPU kernel of the decode walk: `cpu_decode.cc`, built on first use, called through XLA FFI.

On XLA:CPU the decode part of ragged paged attention (each decoding sequence's one query
against the keys already in its pages) is a loop of small gathers and einsums, and each loop
iteration costs ~25 XLA operations of a few microseconds each, so it ran at 10-30% of the
machine's bandwidth (`benchmarks/results/kernels.md`). The C++ kernel reads each key and value
once, straight from its page, and keeps the online-softmax statistics in registers. It returns
exactly what `xla._decode_context_stats` returns, so `xla.py` uses it in that one place and
merges the statistics with the step's own keys as before.

The source is compiled with the system's C++ compiler (`$CXX`, else `g++`) against jaxlib's XLA
FFI headers, with `-O3 -march=native -fopenmp`, into the user's cache directory
(`$JAXINFER_KERNEL_CACHE`, default `~/.cache/jaxinfer/kernels`), keyed by the source, the jaxlib
version and the CPU's feature flags. Where no compiler works, `available()` is False (with one
warning) and the XLA loop runs instead. `JAXINFER_CPU_KERNELS=0` turns the kernel off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = pathlib.Path(__file__).with_name("cpu_decode.cc")
_TARGETS = {"float32": "DecodeAttentionF32", "bfloat16": "DecodeAttentionBF16",
            "int8": "DecodeAttentionS8"}
_MAX_PAGE_SIZE = 64  # the kernel keeps one page of scores on the stack
_MAX_GROUP = 16  # and of each of up to 16 query heads per KV head
_switch = {"off": False}


@contextlib.contextmanager
def disabled():
    """Within the block (while tracing), `supports` is False: the XLA loop runs instead (for
    tests and side-by-side timings)."""
    before = _switch["off"]
    _switch["off"] = True
    try:
        yield
    finally:
        _switch["off"] = before


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> pathlib.Path:
    chosen = os.environ.get("JAXINFER_KERNEL_CACHE")
    if chosen:
        return pathlib.Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxinfer" / "kernels"


def _build() -> pathlib.Path:
    """Compiles the kernel (once per source, jaxlib and CPU); returns the shared library."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    include = jax.ffi.include_dir()
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
             f"-I{include}"]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), jax.__version__,
                                    jax.lib.__version__ if hasattr(jax.lib, "__version__")
                                    else "", _cpu_flags(), compiler, *flags]).encode())
    library = _cache_dir() / f"cpu_decode-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed, so concurrent builders never load a torn file.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = pathlib.Path(scratch) / library.name
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{done.stderr[-2000:]}")
        os.replace(built, library)
    return library


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (False, with one warning, if it cannot be,
    or with `JAXINFER_CPU_KERNELS=0`)."""
    if os.environ.get("JAXINFER_CPU_KERNELS", "1").lower() in ("0", "off", "false"):
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
        for target in _TARGETS.values():
            jax.ffi.register_ffi_target(f"jaxinfer_{target}",
                                        jax.ffi.pycapsule(getattr(library, target)),
                                        platform="cpu")
    except (RuntimeError, OSError) as error:
        warnings.warn(f"the CPU decode-attention kernel is unavailable, using the XLA loop "
                      f"instead: {error}", RuntimeWarning, stacklevel=2)
        return False
    return True


def num_threads() -> int:
    """Threads the kernel splits sequences over: `$JAXINFER_CPU_KERNEL_THREADS`, else the
    cores this process may run on."""
    chosen = os.environ.get("JAXINFER_CPU_KERNEL_THREADS")
    if chosen:
        return max(1, int(chosen))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def supports(kv_pages: jax.Array, group: int) -> bool:
    """Whether the kernel takes this pool (dtype, page size) and GQA group on this backend."""
    return (not _switch["off"] and jax.default_backend() == "cpu"
            and str(kv_pages.dtype) in _TARGETS and kv_pages.shape[-3] <= _MAX_PAGE_SIZE
            and group <= _MAX_GROUP and available())


def decode_context_stats(kv_pages: jax.Array, kv_scales: jax.Array | None,
                         layer: jax.Array | int, page_indices: jax.Array,
                         queries: jax.Array, context: jax.Array, position: jax.Array,
                         window: int, soft_cap: float | None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The softmax statistics of each decode query over its sequence's earlier keys.

    Args:
        kv_pages: `[L, P, Z, 2K, H]` the stacked pool (float32, bfloat16 or int8).
        kv_scales: `[L, P, Z, 2K]` float32 scales of an int8 pool, or None.
        layer: The layer to read.
        page_indices: `[Q, pages_per_seq]` page tables.
        queries: `[Q, K, G, H]` each sequence's (scaled) query.
        context: `[Q]` keys before this step (0: the row is not decoding).
        position: `[Q]` the query's position.
        window: Keys visible per query (itself included).
        soft_cap: Logit soft-cap, or None.

    Returns:
        Running max `[Q, K, G]`, denominator `[Q, K, G]`, weighted values `[Q, K, G, H]`
        (max -inf and zeros for a row without keys), as `xla._decode_context_stats`.
    """
    num_seqs, num_kv_heads, group, head_dim = queries.shape
    quantized = kv_scales is not None
    scales = kv_scales if quantized else jnp.zeros((1,), jnp.float32)  # [L, P, Z, 2K] or [1]
    rows = (num_seqs, num_kv_heads, group)
    call = jax.ffi.ffi_call(
        f"jaxinfer_{_TARGETS[str(kv_pages.dtype)]}",
        (jax.ShapeDtypeStruct(rows, jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
         jax.ShapeDtypeStruct((*rows, head_dim), jnp.float32)))
    return call(kv_pages, scales, jnp.asarray(layer, jnp.int32).reshape(1),
                page_indices.astype(jnp.int32), queries.astype(jnp.float32),
                context.astype(jnp.int32), position.astype(jnp.int32),
                window=np.int32(min(window, np.iinfo(np.int32).max)),
                soft_cap=np.float32(soft_cap or 0.0), quantized=quantized,
                num_threads=np.int32(num_threads()))
