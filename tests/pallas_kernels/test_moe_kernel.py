"""The Pallas grouped-matmul kernel (TPU interpret mode) against the references and megablox."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.moe import (
    grouped_matmul,
    grouped_matmul_int8_reference,
    grouped_matmul_reference,
    moe_ffn,
)
from pallas_kernels.moe import kernel as moe_kernel
from tests.pallas_kernels.interpret import INTERPRET

# Jitted once: run eagerly, the schedule's two dozen small ops take seconds on CPU.
visit_schedule = jax.jit(moe_kernel.visit_schedule, static_argnums=(1, 2, 3))

WIDTH = 128  # K = N; one lane-width tile

# (group sizes, rows M, block_m): the shapes the schedule has to get right.
CASES = {
    "empty_groups": ([0, 9, 0, 7], 16, 8),
    "group_spans_tiles": ([3, 29, 0, 0], 32, 8),
    "tiles_mix_experts": ([5, 6, 7, 6], 24, 16),
    "all_rows_one_expert": ([0, 0, 40, 0], 40, 8),
    "ragged_m": ([4, 11, 2, 13], 30, 8),
    "rows_past_groups": ([2, 0, 3, 1], 21, 8),
    "no_rows_grouped": ([0, 0, 0, 0], 12, 8),
    "one_tile_all_experts": ([16, 16, 16, 16], 64, 64),
}


def _relative_error(actual: jax.Array, expected: jax.Array) -> float:
    actual = np.asarray(actual, np.float64)  # [M, N]
    expected = np.asarray(expected, np.float64)  # [M, N]
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    return float(np.max(np.abs(actual - expected))) / scale


def _inputs(group_sizes: list[int], rows: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 2)
    lhs = jax.random.normal(keys[0], (rows, WIDTH), jnp.float32)  # [M, K]
    rhs = jax.random.normal(keys[1], (len(group_sizes), WIDTH, WIDTH), jnp.float32)  # [E, K, N]
    return lhs, rhs, jnp.array(group_sizes, jnp.int32)  # [M, K], [E, K, N], [E]


def test_visit_schedule_hand_worked():
    # Rows 0-4 expert 1, 5-24 expert 3, 25-27 expert 4, 28-29 no expert, 30-31 padding.
    offsets, tiles, experts, flags = visit_schedule(jnp.array([0, 5, 0, 20, 3, 0], jnp.int32),
                                                    30, 32, 8)
    np.testing.assert_array_equal(offsets, [0, 0, 5, 5, 25, 28, 28])
    np.testing.assert_array_equal(tiles, [0, 0, 1, 2, 3, 3, 3, 3, 3])
    np.testing.assert_array_equal(experts, [1, 3, 3, 3, 3, 4, 4, 4, 4])
    compute, first, last = moe_kernel._COMPUTE, moe_kernel._FIRST, moe_kernel._LAST
    np.testing.assert_array_equal(flags, [compute | first, compute | last,
                                          compute | first | last, compute | first | last,
                                          compute | first, compute | last, 0, 0, 0])


def test_visit_schedule_zero_fills_uncovered_tiles():
    _, tiles, _, flags = visit_schedule(jnp.array([3, 0], jnp.int32), 24, 24, 8)
    np.testing.assert_array_equal(tiles, [0, 1, 2, 2])
    first_last = moe_kernel._FIRST | moe_kernel._LAST
    np.testing.assert_array_equal(flags, [moe_kernel._COMPUTE | first_last, first_last,
                                          first_last, 0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_matmul_matches_reference(case):
    group_sizes, rows, block_m = CASES[case]
    lhs, rhs, sizes = _inputs(group_sizes, rows)
    out = moe_kernel.grouped_matmul(lhs, rhs, sizes, block_m=block_m, block_k=WIDTH,
                                    block_n=WIDTH, interpret=INTERPRET)  # [M, N]
    expected = grouped_matmul_reference(lhs, rhs, sizes)  # [M, N]
    assert out.shape == (rows, WIDTH) and out.dtype == jnp.float32
    assert not np.isnan(np.asarray(out)).any()
    assert _relative_error(out, expected) < 1e-5


def test_grouped_matmul_several_k_and_n_tiles():
    # K and N split in two: exercises the accumulator across K steps and the N grid axis.
    group_sizes, rows = [5, 0, 12, 7], 24
    keys = jax.random.split(jax.random.key(1), 2)
    lhs = jax.random.normal(keys[0], (rows, 256), jnp.float32)  # [M, K]
    rhs = jax.random.normal(keys[1], (4, 256, 256), jnp.float32)  # [E, K, N]
    sizes = jnp.array(group_sizes, jnp.int32)  # [E]
    out = moe_kernel.grouped_matmul(lhs, rhs, sizes, block_m=8, block_k=128, block_n=128,
                                    interpret=INTERPRET)  # [M, N]
    assert _relative_error(out, grouped_matmul_reference(lhs, rhs, sizes)) < 1e-5


@pytest.mark.parametrize("case", ["empty_groups", "tiles_mix_experts", "ragged_m"])
def test_grouped_matmul_int8_matches_reference(case):
    group_sizes, rows, block_m = CASES[case]
    lhs, rhs_float, sizes = _inputs(group_sizes, rows, seed=2)
    scales = jnp.max(jnp.abs(rhs_float), axis=1) / 127.0  # [E, N]
    rhs = jnp.round(rhs_float / scales[:, None, :]).astype(jnp.int8)  # [E, K, N]
    out = moe_kernel.grouped_matmul_int8(lhs, rhs, scales, sizes, block_m=block_m,
                                         block_k=WIDTH, block_n=WIDTH,
                                         interpret=INTERPRET)  # [M, N]
    expected = grouped_matmul_int8_reference(lhs, rhs, scales, sizes)  # [M, N]
    assert not np.isnan(np.asarray(out)).any()
    assert _relative_error(out, expected) < 1e-5
    public = grouped_matmul(lhs, rhs, sizes, scales=scales, implementation="interpret",
                            block_m=block_m)  # [M, N]
    np.testing.assert_array_equal(public, out)


def test_grouped_matmul_bfloat16_within_bf16_rounding():
    group_sizes, rows, block_m = CASES["tiles_mix_experts"]
    lhs, rhs, sizes = _inputs(group_sizes, rows, seed=3)
    lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)  # [M, K], [E, K, N]
    out = moe_kernel.grouped_matmul(lhs, rhs, sizes, block_m=block_m, block_k=WIDTH,
                                    block_n=WIDTH, interpret=INTERPRET)  # [M, N]
    assert out.dtype == jnp.bfloat16
    assert _relative_error(out, grouped_matmul_reference(lhs, rhs, sizes)) < 1e-2


def test_public_grouped_matmul_dispatch():
    group_sizes, rows, _ = CASES["ragged_m"]
    lhs, rhs, sizes = _inputs(group_sizes, rows)
    expected = grouped_matmul_reference(lhs, rhs, sizes)  # [M, N]
    np.testing.assert_array_equal(grouped_matmul(lhs, rhs, sizes, implementation="xla"),
                                  expected)
    with dispatch.force_implementation("interpret"):
        out = grouped_matmul(lhs, rhs, sizes, block_m=8)  # [M, N]
    assert _relative_error(out, expected) < 1e-5


def test_grouped_matmul_rejects_blocks_that_do_not_tile():
    lhs, rhs, sizes = _inputs([4, 4], 8)
    with pytest.raises(ValueError, match="block_k=96 does not divide"):
        moe_kernel.grouped_matmul(lhs, rhs, sizes, block_m=8, block_k=96, block_n=WIDTH,
                                  interpret=INTERPRET)


@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(7, 4, 2), (16, 4, 1)])
def test_moe_ffn_interpret_equals_dense(tokens, num_experts, top_k):
    keys = jax.random.split(jax.random.key(tokens + 7 * num_experts), 5)
    width, hidden = 128, 128
    x = jax.random.normal(keys[0], (tokens, width))  # [M, D]
    router = jax.random.normal(keys[1], (tokens, num_experts))  # [M, E]
    gate = 0.1 * jax.random.normal(keys[2], (num_experts, width, hidden))  # [E, D, F]
    up = 0.1 * jax.random.normal(keys[3], (num_experts, width, hidden))  # [E, D, F]
    down = 0.1 * jax.random.normal(keys[4], (num_experts, hidden, width))  # [E, F, D]
    dense = moe_ffn(x, router, gate, up, down, top_k, implementation="dense")  # [M, D]
    with dispatch.force_implementation("interpret"):
        auto = moe_ffn(x, router, gate, up, down, top_k, implementation="auto")  # [M, D]
    np.testing.assert_allclose(auto, dense, rtol=1e-4, atol=1e-5)
    for name in ("xla", "reference"):
        np.testing.assert_allclose(moe_ffn(x, router, gate, up, down, top_k, name), dense,
                                   rtol=1e-4, atol=1e-5)


def _megablox_gmm():
    try:
        from jax.experimental.pallas.ops.tpu.megablox import gmm
    except ImportError as error:  # pragma: no cover - depends on the installed JAX
        pytest.skip(f"megablox gmm is not importable in this JAX: {error}")
    return gmm


@pytest.mark.parametrize("case", ["empty_groups", "tiles_mix_experts", "ragged_m"])
def test_grouped_matmul_matches_megablox_gmm(case):
    gmm = _megablox_gmm()
    group_sizes, rows, block_m = CASES[case]
    lhs, rhs, sizes = _inputs(group_sizes, rows, seed=4)
    # megablox raises unless M is a multiple of its row tile, so pad M for it.
    padded_rows = -(-rows // block_m) * block_m
    lhs_padded = jnp.pad(lhs, ((0, padded_rows - rows), (0, 0)))  # [Mp, K]
    peer = gmm(lhs_padded, rhs, sizes, preferred_element_type=jnp.float32,
               tiling=(block_m, WIDTH, WIDTH), interpret=True)[:rows]  # [M, N]
    ours = moe_kernel.grouped_matmul(lhs, rhs, sizes, block_m=block_m, block_k=WIDTH,
                                     block_n=WIDTH, interpret=INTERPRET)  # [M, N]
    grouped = int(sum(group_sizes))
    # Rows past the groups are unspecified for megablox; compare the grouped rows only.
    assert _relative_error(ours[:grouped], peer[:grouped]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("block_m", [8, 16, 32])
@pytest.mark.parametrize("seed", range(4))
def test_grouped_matmul_random_group_sizes(block_m, seed):
    rng = np.random.default_rng(seed)
    rows, num_experts = 96, 6
    # Random cut points (repeats make empty groups), leaving up to 8 rows past the groups.
    cuts = np.sort(rng.integers(0, rows + 1, size=num_experts - 1))
    group_sizes = np.diff(np.concatenate([[0], cuts, [rows - int(rng.integers(0, 9))]]))
    group_sizes = np.maximum(group_sizes, 0).astype(np.int32)
    lhs, rhs, sizes = _inputs(group_sizes.tolist(), rows, seed=seed)
    out = moe_kernel.grouped_matmul(lhs, rhs, sizes, block_m=block_m, block_k=WIDTH,
                                    block_n=WIDTH, interpret=INTERPRET)  # [M, N]
    assert _relative_error(out, grouped_matmul_reference(lhs, rhs, sizes)) < 1e-5
