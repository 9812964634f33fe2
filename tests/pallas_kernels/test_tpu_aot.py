"""Every Pallas kernel compiles for TPU v4, v5e, v5p and v6e through Mosaic, on this CPU machine
(`make tpu-check`, in the `jax[tpu]` environment `make tpu-env` builds), within each chip's
VMEM; the harness reports a kernel Mosaic rejects as a failure, and its VMEM figures and
capacities agree with what the compiler says.

The cases are the whole matrix, `aot_cases.MATRIX`: every kernel, weight format and attention
dimension (a few minutes on a 2-core machine). Skipped where libtpu is not installed (the main
environment); where it is installed but broken, the compiles fail instead.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import aot, aot_cases

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(not aot.tpu_compiler_available(),
                       reason="no TPU compiler here (libtpu): run `make tpu-check`"),
]

CHIPS = sorted(aot.TOPOLOGIES)


def _case_id(case: aot_cases.Case) -> str:
    return f"{case.kernel}-{case.name}"


@pytest.mark.parametrize("case", aot_cases.MATRIX, ids=_case_id)
@pytest.mark.parametrize("chip", CHIPS)
def test_kernel_compiles_within_vmem(chip, case):
    result = case.compile(chip)
    if isinstance(case, aot_cases.AttentionCase) and not case.mosaic_lowers:
        # A known Mosaic failure (see `mosaic_lowers`): it must still fail (a kernel that
        # starts compiling should be turned back on), and the XLA path that "auto" takes on
        # TPU instead must compile.
        assert not result.ok, f"{case.name} compiles now: set mosaic_lowers=True"
        fallback = case.compile(chip, implementation="xla")
        assert fallback.ok, fallback.error
        return
    assert result.ok, result.error
    # A Mosaic kernel is in the program (the op took its Pallas path); its scoped VMEM fits
    # the compiler's default limit, and with its scratch the chip's VMEM.
    assert result.vmem_bytes is not None, "no Mosaic kernel in the compiled program"
    assert result.scoped_vmem_bytes <= aot.DEFAULT_SCOPED_VMEM[chip]
    assert result.vmem_bytes <= aot.vmem_capacity(chip)
    if isinstance(case, aot_cases.AttentionCase):
        # The program takes the pool as an argument: at least the pages' bytes.
        assert result.argument_bytes is None or result.argument_bytes >= case.pages_bytes


def _scratch_kernel(x, *, mib: int):
    """Passes `[8, 128]` f32 through the first rows of a `[rows, 128]` f32 VMEM scratch of
    `mib` MiB (only those rows are touched, so the compile stays quick at any size)."""
    from jax.experimental.pallas import tpu as pltpu

    rows = mib * 2**20 // (128 * 4)

    def kernel(x_ref, o_ref, scratch):
        scratch[0:8, :] = x_ref[...] + 1
        o_ref[...] = scratch[0:8, :]

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.MemorySpace.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.MemorySpace.VMEM),
        scratch_shapes=[pltpu.VMEM((rows, 128), jnp.float32)])(x)


_X = jax.ShapeDtypeStruct((8, 128), jnp.float32)


def test_vmem_figures_split_scoped_and_scratch():
    # The compiler's scoped figure holds the kernel's (8, 128) f32 input and output, 4 KiB
    # each, and not its 4 MiB scratch, which is counted from its shape.
    result = aot.compile_for("v5e", _scratch_kernel, [_X], static_kwargs=dict(mib=4))
    assert result.ok, result.error
    assert result.kernel_scoped_vmem == (8192,)
    assert result.kernel_scratch_vmem == (4 * 2**20,)
    assert result.vmem_bytes == 4 * 2**20 + 8192


def _add_one(x):
    """`x + 1` over 8 blocks of `[512, 128]` f32: 256 KiB blocks, pipelined."""
    return pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1), grid=(8,),
        in_specs=[pl.BlockSpec((512, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((512, 128), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def test_scoped_vmem_holds_the_double_buffered_blocks():
    result = aot.compile_for("v5e", _add_one, [jax.ShapeDtypeStruct((4096, 128), jnp.float32)])
    assert result.ok, result.error
    # Input and output, two buffers each, of 256 KiB; no scratch.
    assert result.kernel_scoped_vmem == (4 * 512 * 128 * 4,)
    assert result.kernel_scratch_vmem == (0,)


def test_scratch_vmem_is_padded_to_the_memref_tiling():
    # The attention kernel's running max is [E, rows, 1] f32: Mosaic tiles its last two dims
    # in (8, 128), so each row takes a whole 128-lane line of 512 bytes.
    case = aot_cases.AttentionCase("decode-bf16", num_tokens=64, max_seqs=64)
    result = case.compile("v5e")
    assert result.ok, result.error
    rows = 32 * case.group  # block_tokens (tuning: 32 for 64 tokens) * G
    pages = 2 * 8 * case.page_size * 2 * case.head_dim * 2  # [2, 8, Z, 2, H] bf16 pages
    assert result.kernel_scratch_vmem == (pages + 2 * rows * 128 * 4 + rows * case.head_dim * 4,)


@pytest.mark.parametrize("chip", CHIPS)
def test_vmem_capacity_is_the_compilers(chip):
    result = aot.compile_for(chip, _scratch_kernel, [_X], static_kwargs=dict(mib=1024))
    assert not result.ok
    size = re.search(r"would exceed memory \(size=(\d+)\)", result.error)
    assert size, result.error
    assert int(size.group(1)) == aot.vmem_capacity(chip)


@pytest.mark.parametrize("chip", CHIPS)
def test_default_scoped_vmem_is_the_compilers(chip):
    # The int4 kernel with a block of all of I (explicit block sizes: the op would refuse it)
    # dequantizes more than the default allows: the error states the limit.
    from pallas_kernels.quant_matmul import kernel

    # 16 MiB: 8 tokens and 14336 rows of I take about 21 MiB; 32 MiB: 128 by 28672, 38 MiB.
    rows, depth = (8, 14336) if aot.DEFAULT_SCOPED_VMEM[chip] <= 16 * 2**20 else (128, 28672)
    arguments = [jax.ShapeDtypeStruct((rows, depth), jnp.bfloat16),  # [T, I]
                 jax.ShapeDtypeStruct((depth // 2, 4096), jnp.uint8),  # [I / 2, O]
                 jax.ShapeDtypeStruct((1, 4096), jnp.float32)]  # [C, O]
    result = aot.compile_for(chip, kernel.int4_matmul, arguments, static_kwargs=dict(
        zeros=None, group_size=depth, block_m=max(rows, 32), block_n=256, block_k=depth))
    assert not result.ok
    limit = re.search(r"and limit ([\d.]+)M exceeded|of ([\d.]+)M vmem", result.error)
    assert limit, result.error
    assert float(limit.group(1) or limit.group(2)) * 2**20 == aot.DEFAULT_SCOPED_VMEM[chip]


def _copy_rows(x, *, misaligned: bool):
    """Each of 2 programs copies 8 rows of a `[16, 128]` int8 array in HBM into its output
    block, starting at row 8i (aligned to the 8-row HBM tile) or at row 2i + 1 (a dynamic
    offset on a tiled axis that is not a multiple of the tile: Mosaic rejects it, as it did
    the int8 KV pages of ragged paged attention)."""
    from jax.experimental.pallas import tpu as pltpu

    def kernel(x_hbm, o_ref, semaphore):
        i = pl.program_id(0)
        start = i * 2 + 1 if misaligned else pl.multiple_of(i * 8, 8)
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(start, 8), :], o_ref.at[0], semaphore)
        copy.start()
        copy.wait()

    return pl.pallas_call(
        kernel, grid=(2,),
        in_specs=[pl.BlockSpec(memory_space=pltpu.MemorySpace.HBM)],
        out_specs=pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((2, 8, 128), x.dtype),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    )(x)


def test_harness_reports_a_kernel_mosaic_rejects():
    x = jax.ShapeDtypeStruct((16, 128), jnp.int8)
    aligned = aot.compile_for("v5e", _copy_rows, [x], static_kwargs=dict(misaligned=False))
    assert aligned.ok, aligned.error
    rejected = aot.compile_for("v5e", _copy_rows, [x], static_kwargs=dict(misaligned=True))
    assert not rejected.ok
    assert "Mosaic" in rejected.error and "aligned" in rejected.error, rejected.error
