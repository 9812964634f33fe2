"""Builds the C++ XLA:CPU kernels on first use and registers them as XLA FFI targets.

Each CPU kernel (`ragged_paged_attention/cpu_decode.cc`, `dense_matmul/cpu_matmul.cc`) is a
single C++ file compiled with the system's C++ compiler (`$CXX`, else `g++`) against jaxlib's
XLA FFI headers, with `-O3 -march=native -fopenmp-simd` (the `omp simd` hints; the kernels
split work over XLA's own thread pool, `cpu_parallel.h`, not an OpenMP runtime), into the
user's cache directory (`$JAXINFER_KERNEL_CACHE`, default `~/.cache/jaxinfer/kernels`), keyed
by the source, the shared headers, the jaxlib version and the CPU's feature flags. Where no
compiler works, `load` raises and the caller falls back to XLA. `JAXINFER_CPU_KERNELS=0` turns
every CPU kernel off.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import jax

HEADERS = pathlib.Path(__file__).parent  # the kernels' shared headers: pallas_kernels/*.h


class KernelSwitch:
    """A kernel's off switch for tracing: its `supports` checks `off`, and `disabled()` sets
    it for a block, so the XLA path runs instead (tests and side-by-side timings)."""

    def __init__(self) -> None:
        self.off = False

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within the block (while tracing), the kernel is not used."""
        before = self.off
        self.off = True
        try:
            yield
        finally:
            self.off = before


def enabled_by_environment() -> bool:
    """False when `JAXINFER_CPU_KERNELS` is 0 / off / false."""
    return os.environ.get("JAXINFER_CPU_KERNELS", "1").lower() not in ("0", "off", "false")


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


def build(source: pathlib.Path) -> pathlib.Path:
    """Compiles `source` (once per source, jaxlib and CPU); returns the shared library.

    Raises:
        RuntimeError: No C++ compiler, or the compiler failed (its error is included).
    """
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    include = jax.ffi.include_dir()
    # The kernels include shared headers from this package (`cpu_parallel.h`).
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++17",
             f"-I{include}", f"-I{HEADERS}"]
    headers = [path.read_text() for path in sorted(HEADERS.glob("*.h"))]
    key = hashlib.sha256("\n".join([source.read_text(), *headers, jax.__version__,
                                    jax.lib.__version__ if hasattr(jax.lib, "__version__")
                                    else "", _cpu_flags(), compiler, *flags]).encode())
    library = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed, so concurrent builders never load a torn file.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = pathlib.Path(scratch) / library.name
        done = subprocess.run([compiler, *flags, str(source), "-o", str(built)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{done.stderr[-2000:]}")
        os.replace(built, library)
    return library


def load(source: pathlib.Path, targets: Iterable[str]) -> ctypes.CDLL:
    """Builds `source` and registers each exported handler `T` as FFI target `jaxinfer_T`.

    Returns:
        The loaded library (for any plain C functions it also exports).

    Raises:
        RuntimeError, OSError: The kernel cannot be built or loaded.
    """
    library = ctypes.cdll.LoadLibrary(str(build(source)))
    for target in targets:
        jax.ffi.register_ffi_target(f"jaxinfer_{target}",
                                    jax.ffi.pycapsule(getattr(library, target)),
                                    platform="cpu")
    return library


def kernel_level(source: pathlib.Path, targets: Iterable[str], *, kernel: str,
                 fallback: str, vectorized: str | None = None) -> int:
    """Builds and registers a CPU kernel; which of its paths can run here.

    0, with one warning naming `kernel` and the `fallback` that runs instead, when it cannot
    be built or loaded; 0 with `JAXINFER_CPU_KERNELS=0`; with `vectorized`, what the
    library's C function of that name returns (0: no vector path compiled for this CPU;
    kernels with several paths number them); 1 without.
    """
    if not enabled_by_environment():
        return 0
    try:
        library = load(source, targets)
    except (RuntimeError, OSError) as error:
        warnings.warn(f"the CPU {kernel} kernel is unavailable, using {fallback} instead: "
                      f"{error}", RuntimeWarning, stacklevel=3)
        return 0
    return 1 if vectorized is None else int(getattr(library, vectorized)())


def kernel_available(source: pathlib.Path, targets: Iterable[str], *, kernel: str,
                     fallback: str, vectorized: str | None = None) -> bool:
    """Whether `kernel_level` finds any path of the kernel that can run here."""
    return kernel_level(source, targets, kernel=kernel, fallback=fallback,
                        vectorized=vectorized) > 0


Result = TypeVar("Result")


def on_cpu(kernel: Callable[[], Result], fallback: Callable[[], Result],
           supported: bool = True) -> Result:
    """`kernel()` in a computation lowered for CPU, `fallback()` in one lowered for any other
    platform, or wherever the kernel is not `supported` (its `supports` check).

    `jax.default_backend()` says where eager work runs, not what a computation is compiled
    for: a TPU program compiled ahead of time on a CPU host (`make tpu-check`) saw "cpu" and
    took a CPU kernel's custom call, which no TPU compiler can emit. Both are traced; only the
    lowering platform's is lowered.
    """
    if not supported:
        return fallback()
    return jax.lax.platform_dependent(cpu=kernel, default=fallback)


def single_device() -> bool:
    """Whether no multi-device mesh is active, or every axis is manual (inside `shard_map`):
    the kernels' custom calls have no sharding rule, so a sharded operand keeps XLA's path,
    which the partitioner splits."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh is None or mesh.empty or mesh.size == 1 or mesh.are_all_axes_manual


def num_threads() -> int:
    """Threads a CPU kernel splits its work over: `$JAXINFER_CPU_KERNEL_THREADS`, else the
    cores this process may run on."""
    chosen = os.environ.get("JAXINFER_CPU_KERNEL_THREADS")
    if chosen:
        return max(1, int(chosen))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
