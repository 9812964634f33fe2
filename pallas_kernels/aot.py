"""Ahead-of-time compilation of the Pallas kernels for TPUs, on a machine without one.

Interpret mode (the CPU tests) never runs Mosaic, so a kernel can pass every test and still be
rejected by the TPU compiler. With `jax[tpu]` installed (libtpu pinned to the project's jaxlib:
`make tpu-env`), `jax.experimental.topologies.get_topology_desc` describes a TPU slice whose
devices need not exist here; a function lowered with `jax.ShapeDtypeStruct` inputs placed on a
mesh of those devices, inside `jax.set_mesh` (so Pallas asks the mesh, not the CPU, which TPU it
targets), compiles for that TPU.

`compile_for(topology, build)` does that and returns an `AotResult` instead of raising: a
compile failure is a result (`ok=False`, `error=` the compiler's message), so a case table can
report every failure. `tpu_compiler_available()` says whether libtpu is here at all; this
module imports nothing beyond jax at import time, so it loads in the CPU-only environment.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
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


def tpu_compiler_available() -> bool:
    """Whether this environment can compile for TPU (libtpu installed and matching jaxlib)."""
    try:
        topology_devices("v5e")
    except Exception:  # any failure means: no TPU compiler here
        return False
    return True


@functools.cache
def topology_devices(topology: str) -> tuple[Any, ...]:
    """The devices of a TPU slice described, not attached: `topology` is a `TOPOLOGIES` key
    ("v5e") or a topology name ("v5e:2x4")."""
    from jax.experimental import topologies

    name = TOPOLOGIES.get(topology, topology)
    description = topologies.get_topology_desc(platform="tpu", topology_name=name)
    return tuple(description.devices)


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
            compiled = jax.jit(bound).lower(*placed).compile()
    except Exception as error:  # a compile failure is a result here
        message = "\n".join(str(error).strip().splitlines()[:6])
        return AotResult(topology, False, time.perf_counter() - start,
                         error=f"{type(error).__name__}: {message}")
    seconds = time.perf_counter() - start
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
        flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"))


# ---- ragged paged attention cases ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """A ragged paged attention step, described by sizes only."""

    name: str
    num_tokens: int  # T, packed query tokens
    max_seqs: int  # Q
    num_kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    page_size: int = 16
    pages_per_seq: int = 32
    num_pages: int = 1024
    int8_kv: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None


def attention_arguments(case: AttentionCase) -> list[jax.ShapeDtypeStruct]:
    """The public op's array arguments for `case` (kv_scales last, when int8)."""
    import jax.numpy as jnp

    pages_dtype = jnp.int8 if case.int8_kv else jnp.bfloat16
    arguments = [
        jax.ShapeDtypeStruct((case.num_tokens, case.num_kv_heads * case.group, case.head_dim),
                             jnp.bfloat16),
        jax.ShapeDtypeStruct((case.num_pages, case.page_size, 2 * case.num_kv_heads,
                              case.head_dim), pages_dtype),
        jax.ShapeDtypeStruct((case.max_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((case.max_seqs, case.pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((case.max_seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    ]
    if case.int8_kv:
        arguments.append(jax.ShapeDtypeStruct(
            (case.num_pages, case.page_size, 2 * case.num_kv_heads), jnp.float32))
    return arguments


def _attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales=None,
               *, sm_scale, sliding_window, soft_cap):
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    return ragged_paged_attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  sm_scale=sm_scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap, kv_scales=kv_scales,
                                  implementation="pallas")


def compile_attention(topology: str, case: AttentionCase) -> AotResult:
    """Compiles the public ragged paged attention op (forced to the Pallas kernel) for `case`."""
    return compile_for(topology, _attention, attention_arguments(case), static_kwargs=dict(
        sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window,
        soft_cap=case.soft_cap))


# Decode-only: one token for each of 64 sequences; mixed: 256 tokens, prefill chunks and decodes.
ATTENTION_CASES = tuple(
    AttentionCase(f"{batch}-{'int8' if int8 else 'bf16'}", num_tokens=tokens, max_seqs=seqs,
                  int8_kv=int8)
    for batch, tokens, seqs in (("decode", 64, 64), ("mixed", 256, 64))
    for int8 in (False, True))


def format_bytes(count: int | None) -> str:
    """`count` bytes as MiB with one decimal, or "-" when unknown."""
    return "-" if count is None else f"{count / 2**20:.1f} MiB"
