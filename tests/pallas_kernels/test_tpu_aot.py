"""Every Pallas kernel case compiles for TPU v4, v5e, v5p and v6e through Mosaic, on this CPU
machine (`make tpu-check`, in the `jax[tpu]` environment `make tpu-env` builds), and the
harness reports a kernel Mosaic rejects as a failure.

Skipped where libtpu is not installed (the main environment)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import aot

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(not aot.tpu_compiler_available(),
                       reason="no TPU compiler here (libtpu): run `make tpu-check`"),
]

CHIPS = sorted(aot.TOPOLOGIES)


@pytest.mark.parametrize("case", aot.ATTENTION_CASES, ids=lambda case: case.name)
@pytest.mark.parametrize("chip", CHIPS)
def test_ragged_paged_attention_compiles(chip, case):
    result = aot.compile_attention(chip, case)
    assert result.ok, result.error
    # The program takes the pool as an argument: at least the pages' bytes.
    pages_bytes = (case.num_pages * case.page_size * 2 * case.num_kv_heads * case.head_dim
                   * (1 if case.int8_kv else 2))
    assert result.argument_bytes is None or result.argument_bytes >= pages_bytes


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
