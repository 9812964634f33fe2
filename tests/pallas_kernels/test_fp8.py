"""FP8 (e4m3) weights: rounding stays within e4m3's 3-bit mantissa, the layout's bytes are
1 + 4 / I per parameter, and the kernel (interpret mode) and the XLA path equal the readable
reference on several shapes and both activation dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant_matmul import (
    dequantize_weight,
    fp8,
    fp8_kernel,
    quantize_weight,
    quantized_matmul,
)
from tests.pallas_kernels.interpret import INTERPRET, races_found


def _weight(k: int, n: int, seed: int = 0) -> jax.Array:
    """A random `[k, n]` weight whose columns span a few orders of magnitude."""
    w = jax.random.normal(jax.random.key(seed), (k, n))  # [K, N]
    return w * jnp.logspace(-3, 1, n)[None, :]  # [K, N]


def test_quantize_stores_e4m3_values_and_a_scale_per_column():
    w = _weight(128, 256)
    weight = quantize_weight(w, "fp8")
    assert weight.values.dtype == jnp.float8_e4m3fn and weight.values.shape == (128, 256)
    assert weight.scales.dtype == jnp.float32 and weight.scales.shape == (256,)
    np.testing.assert_allclose(weight.scales, jnp.max(jnp.abs(w), axis=0) / 448, rtol=1e-6)
    # Each column's largest magnitude lands on e4m3's largest value, 448.
    np.testing.assert_array_equal(jnp.max(jnp.abs(weight.values.astype(jnp.float32)), axis=0),
                                  jnp.full((256,), 448.0))


def test_round_trip_error_is_within_the_mantissa():
    w = _weight(512, 128, seed=1)
    weight = quantize_weight(w, "fp8")
    error = jnp.abs(dequantize_weight(weight) - w)  # [K, N]
    scaled = jnp.abs(w) / weight.scales  # [K, N]
    normal = scaled >= 2.0 ** -6  # e4m3's smallest normal
    # 3 mantissa bits: round to nearest is off by at most 2**-4 of the value; below the
    # normal range by half the subnormal step, 2**-10, times the scale.
    assert bool(jnp.all(jnp.where(normal, error <= 2.0 ** -4 * jnp.abs(w) * (1 + 1e-6),
                                  error <= 2.0 ** -10 * weight.scales * (1 + 1e-6))))
    relative = jnp.where(normal, error / jnp.abs(w), 0.0)  # [K, N]
    # The bound is tight: random values come close to it, and most are well inside.
    assert 0.05 < float(jnp.max(relative)) <= 2.0 ** -4 * (1 + 1e-6)
    assert float(jnp.mean(relative)) < 2.0 ** -5


def test_zero_column_stays_zero_and_quantizing_again_is_exact():
    w = _weight(64, 128, seed=2).at[:, 5].set(0.0)  # [K, N]
    weight = quantize_weight(w, "fp8")
    assert float(weight.scales[5]) == 1.0
    np.testing.assert_array_equal(dequantize_weight(weight)[:, 5], jnp.zeros(64))
    # Values already on the grid (times their scale) round to themselves.
    again = quantize_weight(dequantize_weight(weight), "fp8")
    np.testing.assert_array_equal(again.values.astype(jnp.float32),
                                  weight.values.astype(jnp.float32))


def test_bytes_per_parameter_are_one_plus_four_over_i():
    for k, n in ((128, 256), (4096, 512)):
        weight = quantize_weight(jnp.ones((k, n)), "fp8")
        stored = weight.values.nbytes + weight.scales.nbytes
        assert stored / (k * n) == 1 + 4 / k


# (M, I, O, block sizes or None for the defaults): ragged token counts, several steps along
# I and along O, a decode-sized M = 1.
SHAPES = (
    (1, 256, 128, None),
    (40, 256, 384, None),
    (17, 512, 256, (32, 128, 128)),
    (64, 1024, 256, (32, 128, 256)),
)


@pytest.mark.parametrize(("m", "k", "n", "blocks"), SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_reference(m, k, n, blocks, dtype):
    weight = quantize_weight(_weight(k, n, seed=3), "fp8")
    x = jax.random.normal(jax.random.key(4), (m, k)).astype(dtype)  # [M, K]
    expected = fp8.fp8_matmul_reference(x, weight.values, weight.scales,
                                        out_dtype=jnp.float32)  # [M, N]
    block_m, block_n, block_k = blocks or (None, None, None)
    actual = fp8_kernel.fp8_matmul(x, weight.values, weight.scales, block_m=block_m,
                                   block_n=block_n, block_k=block_k, out_dtype=jnp.float32,
                                   interpret=INTERPRET)  # [M, N]
    assert not races_found()
    assert actual.shape == (m, n) and actual.dtype == jnp.float32
    # bf16 x e4m3 products are exact in float32 too, so both dtypes agree to sum rounding.
    scale = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(actual, expected, atol=1e-5 * scale)
    # The public op's XLA path is the reference; its output dtype follows x.
    xla = quantized_matmul(x, weight, implementation="xla")  # [M, N]
    assert xla.dtype == dtype
    np.testing.assert_array_equal(xla, expected.astype(dtype))


def test_reference_equals_the_dequantized_float_matmul():
    weight = quantize_weight(_weight(256, 128, seed=5), "fp8")
    x = jax.random.normal(jax.random.key(6), (8, 256))  # [M, K]
    dense = jnp.matmul(x, dequantize_weight(weight), precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(fp8.fp8_matmul_reference(x, weight.values, weight.scales),
                               dense, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(dense))))


def test_kernel_refuses_other_values_and_mismatched_shapes():
    weight = quantize_weight(_weight(256, 128), "fp8")
    x = jnp.ones((4, 256))  # [M, K]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_kernel.fp8_matmul(x, weight.values.astype(jnp.int8), weight.scales,
                              interpret=INTERPRET)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_kernel.fp8_matmul(jnp.ones((4, 128)), weight.values, weight.scales,
                              interpret=INTERPRET)
    with pytest.raises(ValueError, match="is not a multiple of block_k=384"):
        fp8_kernel.fp8_matmul(x, weight.values, weight.scales, block_k=384,
                              interpret=INTERPRET)
