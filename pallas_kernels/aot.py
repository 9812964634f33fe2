"""Ahead-of-time compilation of the Pallas kernels for TPUs, on a machine without one.

Interpret mode (the CPU tests) never runs Mosaic, so a kernel can pass every test and still be
rejected by the TPU compiler. With `jax[tpu]` installed (libtpu pinned to the project's jaxlib:
`make tpu-env`), `jax.experimental.topologies.get_topology_desc` describes a TPU slice whose
devices need not exist here; a function lowered with `jax.ShapeDtypeStruct` inputs placed on a
mesh of those devices, inside `jax.set_mesh` (so Pallas asks the mesh, not the CPU, which TPU it
targets), compiles for that TPU.

`compile_for(topology, function, arguments)` does that and returns an `AotResult` instead of
raising: a compile failure is a result (`ok=False`, `error=` the compiler's message), so a case
table can report every failure. `tpu_compiler_available()` says whether libtpu is here at all;
this module imports nothing beyond jax at import time, so it loads in the CPU-only environment.

VMEM. A Mosaic kernel's VMEM is two parts, reported apart and added in
`AotResult.vmem_bytes`:

- scoped: what the TPU compiler allocated to the kernel itself, its BlockSpec pipeline
  buffers (double-buffered blocks) and Mosaic's internal scratch. The compiled program's
  HLO carries it in each kernel's custom call config, `"used_scoped_memory_configs"`,
  memory space 1 being VMEM (the space `pltpu.CompilerParams(vmem_limit_bytes=)` sets, see
  jax's `_src/tpu_custom_call.py`). This is the compiler's own figure; it must fit
  `DEFAULT_SCOPED_VMEM`, the limit the compiler enforces on it by default.
- scratch: the kernel's `scratch_shapes` in VMEM, which XLA allocates as separate operands
  that the figure above leaves out (a `tpu_aot` test shows both). Computed from the traced
  `pallas_call`: each scratch shape padded to the memref tiling Mosaic gives it, as jax's
  mirror of that rule (`tpu_info.infer_tiling`) computes it.

Their sum must fit `vmem_capacity(chip)`: one TensorCore's VMEM from jax's hardware table
(`pltpu.get_tpu_info_for_chip`), which the compiler agrees with (a kernel asking for more
fails with "would exceed memory (size=N)", N the same figure; a `tpu_aot` test checks each
chip).

The kernel case tables (the compile matrix) are in `pallas_kernels/aot_cases.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

# The topologies the compile matrix covers: one small slice per TPU generation.
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x4", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


@dataclasses.dataclass(frozen=True)
class AotResult:
    """One compile: whether it succeeded, and what the compiler reports about the program.

    Byte counts come from `compiled.memory_analysis()` (per device; None where the compiler
    gives none); `error` is the first lines of the compile error when `ok` is False.
    """

    topology: str
    ok: bool
    seconds: float
    error: str | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    generated_code_bytes: int | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    kernel_scoped_vmem: tuple[int, ...] = ()
    kernel_scratch_vmem: tuple[int, ...] = ()

    @property
    def scoped_vmem_bytes(self) -> int | None:
        """The most scoped VMEM (pipeline buffers and internal scratch, the compiler's figure)
        of any Mosaic kernel in the program, or None when it has none."""
        return max(self.kernel_scoped_vmem) if self.kernel_scoped_vmem else None

    @property
    def scratch_vmem_bytes(self) -> int | None:
        """The most VMEM scratch operands (computed from their shapes) of any kernel."""
        return max(self.kernel_scratch_vmem) if self.kernel_scratch_vmem else None

    @property
    def vmem_bytes(self) -> int | None:
        """A Mosaic kernel's whole VMEM, scoped plus scratch: exact for a program of one
        kernel, the largest of each part (an upper bound) for several; kernels run one at a
        time, so this is what must fit. None when the program has no Mosaic kernel."""
        if self.scoped_vmem_bytes is None:
            return None
        return self.scoped_vmem_bytes + (self.scratch_vmem_bytes or 0)


def tpu_compiler_available() -> bool:
    """Whether libtpu, the TPU compiler, is installed in this environment.

    Only whether it is installed: where it is but fails to load (a libtpu that does not match
    jaxlib, say), every compile reports the failure, so a broken TPU environment fails its
    checks instead of skipping them.
    """
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def topology_devices(topology: str) -> tuple[Any, ...]:
    """The devices of a TPU slice described, not attached: `topology` is a `TOPOLOGIES` key
    ("v5e") or a topology name ("v5e:2x4")."""
    from jax.experimental import topologies

    # libtpu takes a lock file (/tmp/libtpu_lockfile) so that two processes do not drive one
    # TPU; describing a topology and compiling for it attach to no chip, so another process
    # holding the lock (a second check, a colleague's compile) must not stop this one.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    name = TOPOLOGIES.get(topology, topology)
    description = topologies.get_topology_desc(platform="tpu", topology_name=name)
    return tuple(description.devices)


def vmem_capacity(topology: str) -> int:
    """VMEM bytes of one TensorCore of `topology`'s chip (a `TOPOLOGIES` key or a topology
    name), from jax's table of TPU hardware (`pltpu.get_tpu_info_for_chip`): 16 MiB on v4,
    128 MiB on v5e and v6e, 64 MiB on v5p in jax 0.10.2. A Mosaic kernel runs on one
    TensorCore (megacore chips split a kernel's parallel grid over two cores with their own
    VMEM), so this is what a kernel's VMEM must fit."""
    from jax.experimental.pallas import tpu as pltpu

    device = topology_devices(topology)[0]
    chip = TOPOLOGIES.get(topology, topology).split(":")[0]
    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip), getattr(device, "num_cores", 1))
    return int(info.vmem_capacity_bytes)


# The VMEM a Mosaic kernel may use by default (XLA's --xla_tpu_scoped_vmem_limit_kib; a kernel
# may ask for more with `pltpu.CompilerParams(vmem_limit_bytes=)`, which ours do not), as libtpu
# 0.0.42.1 states it when a kernel goes over: "Scoped allocation with size ... and limit
# 16.00M" for v5e and v5p, "limit 32.00M" for v6e; on v4 the whole 16 MiB ("Used ... of 16.00M
# vmem. Exceeded vmem capacity"). A `tpu_aot` test reads these messages again for each chip.
DEFAULT_SCOPED_VMEM = {"v4": 16 * 2**20, "v5e": 16 * 2**20, "v5p": 16 * 2**20,
                       "v6e": 32 * 2**20}


# In a compiled program's HLO text, the backend config of each Mosaic kernel (a
# "tpu_custom_call") ends with the scoped memory the compiler gave it, one entry per memory
# space; space 1 is VMEM.
_SCOPED_CONFIGS = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')
_VMEM_ENTRY = re.compile(r'\{"memory_space":"1","offset":"\d+","size":"(\d+)"\}')


def kernel_scoped_vmem(hlo_text: str) -> tuple[int, ...]:
    """The scoped VMEM each Mosaic kernel in a compiled program's HLO text was given."""
    sizes = []
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        configs = _SCOPED_CONFIGS.search(line)
        entries = _VMEM_ENTRY.findall(configs.group(1)) if configs else []
        sizes.append(sum(int(size) for size in entries))
    return tuple(sizes)


def _pallas_calls(jaxpr: Any) -> Iterator[Any]:
    """Every `pallas_call` equation of a jaxpr, nested ones (inside jit, ...) included."""
    from jax.extend import core

    for equation in jaxpr.eqns:
        if equation.primitive.name == "pallas_call":
            yield equation
            continue
        for parameter in equation.params.values():
            inner = parameter.jaxpr if isinstance(parameter, core.ClosedJaxpr) else parameter
            if isinstance(inner, core.Jaxpr):
                yield from _pallas_calls(inner)


def _tiled_bytes(aval: Any) -> int:
    """Bytes of an array in VMEM, its trailing dims padded to Mosaic's memref tiling (traced
    inside `jax.set_mesh`, so the tiling is the target TPU's)."""
    import numpy as np
    from jax._src.pallas.mosaic import tpu_info

    tiling = tpu_info.infer_tiling(aval)
    padded = [-(-size // tile) * tile for size, tile in zip(aval.shape, tiling, strict=True)]
    return int(np.prod(padded, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def kernel_scratch_vmem(jaxpr: Any) -> tuple[int, ...]:
    """Bytes of the VMEM scratch operands of each `pallas_call` in a traced program."""
    sizes = []
    for equation in _pallas_calls(jaxpr):
        scratch = equation.params["grid_mapping"].scratch_avals
        sizes.append(sum(_tiled_bytes(ref.inner_aval) for ref in scratch
                         if str(getattr(ref, "memory_space", "")) == "vmem"))
    return tuple(sizes)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def compile_for(
    topology: str,
    function: Callable[..., Any],
    arguments: Sequence[jax.ShapeDtypeStruct],
    *,
    static_kwargs: dict[str, Any] | None = None,
) -> AotResult:
    """Compiles `function(*arguments, **static_kwargs)` for one device of `topology`'s TPU.

    Args:
        topology: A `TOPOLOGIES` key or a topology name.
        function: The jax function to compile (a public op, or a kernel call).
        arguments: Its array arguments as `jax.ShapeDtypeStruct`s (shape and dtype only; they
            are replicated over a one-device mesh).
        static_kwargs: Keyword arguments bound before jitting (sizes, flags).

    Returns:
        An `AotResult`; a lowering or compile error gives `ok=False` rather than raising.
    """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = topology_devices(topology)
    mesh = Mesh(devices[:1], ("x",))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
              for a in arguments]
    bound = functools.partial(function, **(static_kwargs or {}))
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            traced = jax.jit(bound).trace(*placed)
            compiled = traced.lower().compile()
            seconds = time.perf_counter() - start
            scratch = kernel_scratch_vmem(traced.jaxpr.jaxpr)
    except Exception as error:  # a compile failure is a result here
        message = "\n".join(str(error).strip().splitlines()[:6])
        return AotResult(topology, False, time.perf_counter() - start,
                         error=f"{type(error).__name__}: {message}")
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one dict per program
        cost = cost[0] if cost else None
    cost = cost or {}
    return AotResult(
        topology, True, seconds,
        argument_bytes=_int_or_none(getattr(memory, "argument_size_in_bytes", None)),
        output_bytes=_int_or_none(getattr(memory, "output_size_in_bytes", None)),
        temp_bytes=_int_or_none(getattr(memory, "temp_size_in_bytes", None)),
        generated_code_bytes=_int_or_none(getattr(memory, "generated_code_size_in_bytes", None)),
        flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"),
        kernel_scoped_vmem=kernel_scoped_vmem(compiled.as_text()),
        kernel_scratch_vmem=scratch)


def format_bytes(count: int | None) -> str:
    """`count` bytes as MiB with one decimal, or "-" when unknown."""
    return "-" if count is None else f"{count / 2**20:.1f} MiB"
