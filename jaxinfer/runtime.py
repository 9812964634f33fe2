"""Process-wide settings that make XLA fast to run and fast to start: the host allocator and
the persistent compilation cache.

**Host allocator (glibc malloc).** XLA:CPU allocates a fresh buffer for each large temporary
and output of a step, and glibc hands any request above its mmap threshold (128 KiB to
32 MiB, adaptive) to a new `mmap`, and each worker thread's arena is capped at 64 MiB. Every
such buffer is therefore new memory that faults page by page on first write, and the kernel
zeroes each page: on the 2-vCPU machines of this project, writing a fresh 67 MB buffer runs
at ~8.5 GB/s against ~40 GB/s into reused memory, and gathering the KV pages of a decode step
(a 50 MB temporary) took 3x longer than the same gather into reused memory
(`benchmarks/results/engine.md`). `tune_host_allocator` makes glibc serve large blocks from
one heap and keep freed memory for reuse (one arena, mmap threshold 1 GiB, no trimming), as
vLLM's CPU backend gets from preloading tcmalloc. The cost is that the process's resident
memory stays at its high-water mark. It runs when `jaxinfer` is imported, before XLA starts
its threads (arenas made before it are not changed), and only on glibc; set
`JAXINFER_TUNE_MALLOC=0` to leave malloc alone.

**Persistent compilation cache.** Compiled programs are written under the user's cache
directory and read back by the next process that compiles the same program (the same model
shapes, engine sizes, jax version and flags), so a second start of the same engine skips XLA.
`enable_compilation_cache` turns it on unless the user already chose a directory; the
directory is `$JAXINFER_COMPILATION_CACHE` (default `$XDG_CACHE_HOME/jaxinfer/xla`, i.e.
`~/.cache/jaxinfer/xla`), and `JAXINFER_COMPILATION_CACHE=off` (or the engine option
`compilation_cache="off"`) switches it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
import platform

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_MMAP_THRESHOLD = 1 << 30  # bytes: blocks below it come from the heap and are reused
_TRIM_THRESHOLD = 2 ** 31 - 1  # bytes of free heap top kept rather than returned to the OS

# Programs that compile faster than this are not written to the persistent cache (jax's
# default is 1 s; the engine's small helper programs add up to seconds at start-up).
_CACHE_MIN_COMPILE_SECONDS = 0.2

OFF = ("0", "off", "none", "false", "")

_state: dict[str, object] = {"malloc": None, "cache_dir": None}


def tune_host_allocator() -> bool:
    """Sets glibc malloc up for XLA's large, short-lived buffers (see the module docstring).

    Returns:
        Whether the settings were applied (False off glibc, or with `JAXINFER_TUNE_MALLOC=0`).
    """
    if _state["malloc"] is not None:
        return bool(_state["malloc"])
    applied = False
    if (os.environ.get("JAXINFER_TUNE_MALLOC", "1").lower() not in OFF
            and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in (
            (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)))
    _state["malloc"] = applied
    return applied


def default_cache_dir() -> pathlib.Path | None:
    """Where compiled programs are cached: `$JAXINFER_COMPILATION_CACHE`, else
    `$XDG_CACHE_HOME/jaxinfer/xla` (`~/.cache/jaxinfer/xla`); None when switched off."""
    chosen = os.environ.get("JAXINFER_COMPILATION_CACHE")
    if chosen is not None:
        return None if chosen.lower() in OFF else pathlib.Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxinfer" / "xla"


def enable_compilation_cache(directory: str | os.PathLike[str] | None = None
                             ) -> pathlib.Path | None:
    """Turns jax's persistent compilation cache on (once per process).

    Args:
        directory: Where to keep compiled programs; None: `default_cache_dir()`; "off":
            leave the cache off.

    Returns:
        The directory in use, or None when the cache is off. A directory the user set
        through jax's own `jax_compilation_cache_dir` is kept and returned.
    """
    import jax  # here, so that `import jaxinfer` (which tunes malloc) stays light

    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return pathlib.Path(configured)
    if directory is not None and str(directory).lower() in OFF:
        return None
    path = pathlib.Path(directory).expanduser() if directory is not None else (
        default_cache_dir())
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _CACHE_MIN_COMPILE_SECONDS)
    _state["cache_dir"] = path
    return path
