"""The host allocator (glibc malloc), set up for XLA:CPU's large, short-lived buffers.

XLA:CPU allocates a fresh buffer for each large temporary
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
"""


from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_MMAP_THRESHOLD = 1 << 30  # bytes: blocks below it come from the heap and are reused
_TRIM_THRESHOLD = 2 ** 31 - 1  # bytes of free heap top kept rather than returned to the OS

OFF = ("0", "off", "none", "false", "")

_state: dict[str, bool | None] = {"malloc": None}


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
