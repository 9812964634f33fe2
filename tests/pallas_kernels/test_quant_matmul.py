"""Quantized matmul: quantizer error bounds, int4 packing, kernels (interpret mode) vs reference.

Interpret mode is slow on CPU, so the default grid uses K = N = 256 with 128 blocks; the
larger shapes with the default block table are marked slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.quant_matmul import (
    QuantizedWeight,
    dequantize_weight,
    kernel,
    quantize_weight,
    quantized_matmul,
    reference,
    tuning,
)
from tests.pallas_kernels.interpret import INTERPRET

BLOCKS = {"block_m": 32, "block_n": 128, "block_k": 128}
K, N = 256, 256
# (format, group_size, symmetric): every weight layout the kernels support.
WEIGHT_CASES = [
    ("int8", None, True),
    ("int4", 32, True),
    ("int4", 32, False),
    ("int4", 128, True),
    ("int4", 128, False),
    ("w8a8", None, True),
    ("int8_grouped", 32, True),
]


def _random(seed: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _relative_error(actual: jax.Array, expected: jax.Array) -> float:
    # Normalized by the largest reference entry: an elementwise ratio blows up on entries
    # that cancel to nearly zero, where float32 summation order alone decides the digits.
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def _run_kernel(x, weight: QuantizedWeight, **options):
    if weight.format == "int8":
        return kernel.int8_matmul(x, weight.values, weight.scales, **options)
    if weight.format == "int4":
        return kernel.int4_matmul(x, weight.values, weight.scales, weight.zeros,
                                  group_size=weight.group_size, **options)
    if weight.format == "int8_grouped":
        return kernel.int8_grouped_matmul(x, weight.values, weight.scales,
                                          group_size=weight.group_size, **options)
    return kernel.w8a8_matmul(x, weight.values, weight.scales, **options)


# --- quantizers -----------------------------------------------------------------------------


def test_int8_per_channel_round_trip_within_half_a_step():
    w = _random(0, (K, N)).at[:, 3].set(0.0)  # [K, N] with an all-zero channel
    values, scales = reference.quantize_int8_per_channel(w)
    assert values.dtype == jnp.int8 and values.shape == (K, N) and scales.shape == (N,)
    error = jnp.abs(reference.dequantize_int8_per_channel(values, scales) - w)  # [K, N]
    assert bool(jnp.all(error <= scales[None, :] * (0.5 + 1e-5)))
    assert int(jnp.max(jnp.abs(values))) == 127
    assert bool(jnp.all(values[:, 3] == 0)) and bool(jnp.all(jnp.isfinite(scales)))


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_grouped_round_trip_within_half_a_step(group_size, symmetric):
    w = _random(1, (K, N)) + (0.0 if symmetric else 0.7)  # [K, N]; offset favours zeros
    packed, scales, zeros = reference.quantize_int4_grouped(w, group_size, symmetric=symmetric)
    groups = K // group_size
    assert packed.shape == (K // 2, N) and packed.dtype == jnp.uint8
    assert scales.shape == (groups, N)
    assert (zeros is None) == symmetric
    if not symmetric:
        assert zeros.shape == (groups, N) and zeros.dtype == jnp.int8
    restored = reference.dequantize_int4_grouped(packed, scales, zeros, group_size)  # [K, N]
    step = jnp.repeat(scales, group_size, axis=0)  # [K, N]
    assert bool(jnp.all(jnp.abs(restored - w) <= step * (0.5 + 1e-5)))


def test_asymmetric_int4_is_tighter_on_one_sided_weights():
    w = jnp.abs(_random(2, (K, N)))  # [K, N] all nonnegative: symmetric wastes half the levels
    errors = []
    for symmetric in (True, False):
        quantized = reference.quantize_int4_grouped(w, 32, symmetric=symmetric)
        restored = reference.dequantize_int4_grouped(*quantized, 32)
        errors.append(float(jnp.mean(jnp.abs(restored - w))))
    assert errors[1] < 0.7 * errors[0]


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("symmetric", [True, False])
def test_narrower_grids_in_nibbles_round_trip_within_half_a_step(bits, symmetric):
    w = _random(30, (K, N)) + (0.0 if symmetric else 0.7)  # [K, N]
    weight = quantize_weight(w, "int4", group_size=32, symmetric=symmetric, bits=bits)
    assert weight.bits == bits and weight.values.shape == (K // 2, N)
    values = reference.unpack_int4(weight.values)  # [K, N]
    lowest, highest = reference.int4_levels(bits, symmetric)
    assert int(jnp.min(values)) >= lowest and int(jnp.max(values)) <= highest
    # Symmetric b bits use 2^b - 1 levels, asymmetric all 2^b.
    assert highest - lowest == 2 ** bits - (2 if symmetric else 1)
    restored = dequantize_weight(weight)  # [K, N]
    step = jnp.repeat(weight.scales, 32, axis=0)  # [K, N]
    assert bool(jnp.all(jnp.abs(restored - w) <= step * (0.5 + 1e-5)))


def test_three_bit_symmetric_grid_by_hand():
    # One group of 4 rows, 3 bits symmetric: levels -3..3, scale = max|w| / 3 = 0.5.
    w = jnp.asarray([[1.5], [-0.74], [0.26], [0.0]])  # [4, 1]
    weight = quantize_weight(w, "int4", group_size=4, bits=3)
    np.testing.assert_allclose(weight.scales, [[0.5]])
    np.testing.assert_array_equal(reference.unpack_int4(weight.values)[:, 0], [3, -1, 1, 0])
    with pytest.raises(ValueError, match="2 to 4 bits"):
        quantize_weight(w, "int4", group_size=4, bits=5)
    with pytest.raises(ValueError, match="8-bit"):
        quantize_weight(w, "int8", bits=4)


def test_int4_pack_unpack_is_exact():
    values = jax.random.randint(jax.random.key(3), (K, N), -8, 8).astype(jnp.int8)  # [K, N]
    packed = reference.pack_int4(values)  # [K // 2, N]
    np.testing.assert_array_equal(reference.unpack_int4(packed), values)
    every_pair = jnp.array([[low, high] for low in range(-8, 8) for high in range(-8, 8)],
                           jnp.int8).T  # [2, 256]: all byte values
    np.testing.assert_array_equal(reference.unpack_int4(reference.pack_int4(every_pair)),
                                  every_pair)


def test_int4_packing_puts_even_rows_in_the_low_nibble():
    values = jnp.array([[1, -1], [-2, 7]], jnp.int8)  # [2, 2]
    np.testing.assert_array_equal(reference.pack_int4(values), [[0xE1, 0x7F]])


def test_per_token_int8_round_trip():
    x = _random(4, (40, K)) * jnp.arange(1, 41)[:, None]  # [40, K] rows of different range
    x = x.at[5].set(0.0)
    values, scales = reference.quantize_per_token_int8(x)
    assert values.dtype == jnp.int8 and scales.shape == (40,)
    error = jnp.abs(values.astype(jnp.float32) * scales[:, None] - x)  # [40, K]
    assert bool(jnp.all(error <= scales[:, None] * (0.5 + 1e-5)))
    assert bool(jnp.all(values[5] == 0))


@pytest.mark.parametrize(("weight_format", "group_size", "symmetric"), WEIGHT_CASES)
def test_references_approximate_the_float_matmul(weight_format, group_size, symmetric):
    x, w = _random(5, (16, K)), _random(6, (K, N))
    weight = quantize_weight(w, weight_format, group_size=group_size or 128,
                             symmetric=symmetric)
    exact = x @ w  # [16, N]
    tolerance = 0.2 if weight_format == "int4" else 0.02
    assert _relative_error(quantized_matmul(x, weight, implementation="reference"),
                           exact) < tolerance


# --- kernels vs reference (interpret mode) ---------------------------------------------------


@pytest.mark.parametrize(("weight_format", "group_size", "symmetric"), WEIGHT_CASES)
# M = 8 pads one block of 32; M = 40 is two blocks, the second padded. bf16 at M = 8 adds
# nothing the other three cases miss, and interpret mode costs seconds per case.
@pytest.mark.parametrize(("dtype", "m"), [(jnp.float32, 8), (jnp.float32, 40),
                                          (jnp.bfloat16, 40)])
def test_kernel_matches_reference(weight_format, group_size, symmetric, dtype, m):
    x = _random(7 + m, (m, K), dtype)  # [M, K]
    weight = quantize_weight(_random(8, (K, N)), weight_format, group_size=group_size or 128,
                             symmetric=symmetric)
    actual = _run_kernel(x, weight, out_dtype=jnp.float32, interpret=INTERPRET, **BLOCKS)
    expected = quantized_matmul(x, weight, implementation="reference",
                                out_dtype=jnp.float32)  # [M, N]
    assert actual.shape == (m, N) and actual.dtype == jnp.float32
    if weight_format == "w8a8":
        # Identical int32 accumulators and identical rescale operations: bit for bit.
        np.testing.assert_array_equal(actual, expected)
    else:
        assert _relative_error(actual, expected) < 1e-5


@pytest.mark.parametrize("int8_matmul", [True, False])
def test_w8a8_int32_accumulator_is_exact(int8_matmul):
    # int8_matmul=False is the TPU v4 path: int8 values multiplied as bf16, summed in f32.
    x_values = jax.random.randint(jax.random.key(9), (40, K), -127, 128).astype(jnp.int8)
    w_values = jax.random.randint(jax.random.key(10), (K, N), -127, 128).astype(jnp.int8)
    actual = kernel.w8a8_int32_product(x_values, w_values, interpret=INTERPRET,
                                       int8_matmul=int8_matmul, **BLOCKS)
    assert actual.dtype == jnp.int32 and actual.shape == (40, N)
    np.testing.assert_array_equal(actual,
                                  reference.w8a8_int32_product_reference(x_values, w_values))


def test_w8a8_float_path_sums_exactly_past_two_to_the_24():
    # One block of 2048 rows of I: 2047 products of (-128)^2 = 2**14 and one of 1 sum to
    # 2047 * 2**14 + 1, an odd number past 2**24 that float32 cannot hold; the float path
    # stays exact only because it sums 1024 rows at a time in f32 and the chunks in int32.
    depth = 2048
    x_values = jnp.full((8, depth), -128, jnp.int8).at[:, -1].set(1)  # [T, I]
    w_values = jnp.full((depth, 128), -128, jnp.int8).at[-1, :].set(1)  # [I, O]
    actual = kernel.w8a8_int32_product(x_values, w_values, interpret=INTERPRET,
                                       int8_matmul=False, block_m=32, block_n=128,
                                       block_k=depth)
    np.testing.assert_array_equal(actual, np.full((8, 128), 2047 * 2**14 + 1, np.int32))


def test_kernel_output_dtype_defaults_to_activation_dtype():
    x = _random(11, (8, K), jnp.bfloat16)
    weight = quantize_weight(_random(12, (K, N)), "int8")
    out = _run_kernel(x, weight, interpret=INTERPRET, **BLOCKS)
    assert out.dtype == jnp.bfloat16
    expected = quantized_matmul(x, weight, implementation="xla")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               rtol=1e-2, atol=1e-2)


# --- shape errors ------------------------------------------------------------------------------


def test_k_not_a_multiple_of_block_k_is_a_clear_error():
    weight = quantize_weight(_random(13, (192, N)), "int8")
    with pytest.raises(ValueError, match=r"K=192 .* not a multiple of block_k=128"):
        kernel.int8_matmul(_random(14, (8, 192)), weight.values, weight.scales,
                           interpret=INTERPRET, **BLOCKS)


def test_n_not_a_multiple_of_block_n_is_a_clear_error():
    weight = quantize_weight(_random(15, (K, 192)), "w8a8")
    with pytest.raises(ValueError, match=r"N=192 .* not a multiple of block_n=128"):
        kernel.w8a8_matmul(_random(16, (8, K)), weight.values, weight.scales,
                           interpret=INTERPRET, **BLOCKS)


def test_int4_group_size_errors():
    with pytest.raises(ValueError, match=r"group_size must be even and divide K; got K=96"):
        reference.quantize_int4_grouped(_random(17, (96, N)), 64)
    weight = quantize_weight(_random(18, (384, N)), "int4", group_size=96)
    with pytest.raises(ValueError,
                       match=r"block_k=128 is neither a multiple nor a divisor of group_size=96"):
        kernel.int4_matmul(_random(19, (8, 384)), weight.values, weight.scales, None,
                           group_size=96, interpret=INTERPRET, **BLOCKS)
    weight = quantize_weight(_random(18, (K, N)), "int4", group_size=256)
    with pytest.raises(ValueError, match=r"K=256 .* not a multiple of group_size=96"):
        kernel.int4_matmul(_random(19, (8, K)), weight.values, weight.scales, None,
                           group_size=96, interpret=INTERPRET)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_blocks_inside_a_group_match_the_reference(symmetric):
    # block_k = 128 rows of a 256-row group: two blocks of I share each group's scales.
    weight = quantize_weight(_random(28, (2 * K, N)), "int4", group_size=256,
                             symmetric=symmetric)
    x = _random(29, (8, 2 * K))
    actual = kernel.int4_matmul(x, weight.values, weight.scales, weight.zeros, group_size=256,
                                interpret=INTERPRET, **BLOCKS)
    expected = quantized_matmul(x, weight, implementation="xla")
    assert _relative_error(actual, expected) < 1e-5


def test_int8_grouped_dequantizes_by_hand():
    values = jnp.array([[1, -2], [3, 4], [-5, 6], [7, -8]], jnp.int8)  # [4, 2]
    scales = jnp.array([[0.5, 2.0], [0.25, -1.0]], jnp.float32)  # [2, 2] groups of 2 rows
    weight = QuantizedWeight("int8_grouped", values, scales, None, 2)
    expected = jnp.array([[0.5, -4.0], [1.5, 8.0], [-1.25, -6.0], [1.75, 8.0]])
    np.testing.assert_array_equal(dequantize_weight(weight), expected)


def test_int4_float_zero_points_match_the_reference():
    # GGUF's Q4_1 as int4: (value - zero) * scale with a zero point that is no whole step.
    weight = quantize_weight(_random(32, (K, N)), "int4", group_size=32, symmetric=False)
    zeros = weight.zeros.astype(jnp.float32) + 0.37 * _random(33, weight.zeros.shape)  # [C, N]
    weight = QuantizedWeight("int4", weight.values, weight.scales, zeros, 32)
    values = reference.unpack_int4(weight.values).astype(jnp.float32)  # [K, N]
    by_hand = (values - jnp.repeat(zeros, 32, axis=0)) * jnp.repeat(weight.scales, 32, axis=0)
    np.testing.assert_allclose(dequantize_weight(weight), by_hand, rtol=1e-6, atol=1e-6)
    x = _random(34, (40, K))
    actual = kernel.int4_matmul(x, weight.values, weight.scales, zeros, group_size=32,
                                out_dtype=jnp.float32, interpret=INTERPRET, **BLOCKS)
    expected = quantized_matmul(x, weight, implementation="xla", out_dtype=jnp.float32)
    assert _relative_error(actual, expected) < 1e-5


def test_int4_group_too_large_for_a_block_is_refused_before_compiling():
    # lcm(128, 1000) = 16000 > I = 4000: a block of whole groups in whole lane tiles is all
    # 4000 rows of I, over the kernel's VMEM budget. The XLA path still takes the weight.
    weight = quantize_weight(_random(30, (4000, 128)), "int4", group_size=1000)
    x = _random(31, (4, 4000))
    with pytest.raises(ValueError, match=r"group_size=1000 with K=4000 takes blocks of "
                                         r"block_k=4000 rows of I.*over the 2048"):
        quantized_matmul(x, weight, implementation="interpret")
    assert quantized_matmul(x, weight, implementation="xla").shape == (4, 128)


def test_mismatched_inner_dimension_is_a_clear_error():
    weight = quantize_weight(_random(20, (K, N)), "int8")
    with pytest.raises(ValueError, match=r"x has shape \(8, 128\)"):
        quantized_matmul(_random(21, (8, 128)), weight, implementation="interpret")


# --- the public op -----------------------------------------------------------------------------


@pytest.mark.parametrize(("weight_format", "group_size", "symmetric"),
                         [("int8", None, True), ("int4", 128, False), ("w8a8", None, True)])
def test_public_op_xla_and_interpret_agree(weight_format, group_size, symmetric):
    x = _random(22, (2, 5, K))  # [2, 5, K]: leading axes are flattened into 10 tokens
    weight = quantize_weight(_random(23, (K, N)), weight_format, group_size=group_size or 128,
                             symmetric=symmetric)
    xla = quantized_matmul(x, weight, implementation="xla")
    interpreted = quantized_matmul(x, weight, implementation="interpret")
    assert xla.shape == interpreted.shape == (2, 5, N)
    assert _relative_error(interpreted, xla) < 1e-5


def test_public_op_follows_forced_implementation_and_jits(monkeypatch):
    calls = []
    original = kernel.int8_matmul

    def recording(*args, **kwargs):
        calls.append(kwargs["interpret"])
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "int8_matmul", recording)
    x = _random(24, (8, K))
    weight = quantize_weight(_random(25, (K, N)), "int8")
    quantized_matmul(x, weight)  # "auto" on CPU: the reference, no kernel call
    assert calls == []
    with dispatch.force_implementation("interpret"):
        # The weight crosses the jit boundary as a pytree; its format stays static.
        forced = jax.jit(quantized_matmul)(x, weight)
    assert calls == [dispatch.interpret_mode("interpret")]
    assert _relative_error(forced, quantized_matmul(x, weight, implementation="xla")) < 1e-5


def test_quantized_weight_validation_and_shape():
    weight = quantize_weight(_random(26, (K, N)), "int4", group_size=64)
    assert weight.shape == (K, N) and weight.group_size == 64
    assert dequantize_weight(weight).shape == (K, N)
    with pytest.raises(ValueError, match="unknown quantized weight format"):
        quantize_weight(_random(27, (K, N)), "int2")
    with pytest.raises(ValueError, match="needs group_size"):
        QuantizedWeight("int4", weight.values, weight.scales)


def test_default_block_sizes_fit_the_shape():
    assert tuning.default_block_sizes("int8", 8, 4096, 4096) == (32, 256, 512)
    assert tuning.default_block_sizes("int8", 1000, 4096, 4096) == (128, 256, 512)
    # 384 is not a multiple of 256, and 768 not of 512: the largest dividing tiles win.
    assert tuning.default_block_sizes("int4", 8, 768, 384, group_size=128) == (32, 128, 384)
    # No multiple of 128 divides 200: the whole dimension is one block.
    assert tuning.default_block_sizes("w8a8", 8, 200, 200) == (32, 200, 200)
    # A group larger than the preferred block_k: block_k divides the group instead.
    assert tuning.default_block_sizes("int4", 8, 14336, 4096, group_size=14336) == (32, 256, 512)
    assert tuning.default_block_sizes("int4", 8, 4096, 4096, group_size=768) == (32, 256, 384)


# --- larger shapes, default blocks (slow) ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("weight_format", "group_size", "symmetric"), WEIGHT_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference_default_blocks_large(weight_format, group_size, symmetric,
                                                       dtype):
    m, k, n = 300, 1024, 768
    x = _random(28, (m, k), dtype)
    weight = quantize_weight(_random(29, (k, n)), weight_format, group_size=group_size or 128,
                             symmetric=symmetric)
    actual = _run_kernel(x, weight, out_dtype=jnp.float32, interpret=INTERPRET)
    expected = quantized_matmul(x, weight, implementation="reference", out_dtype=jnp.float32)
    if weight_format == "w8a8":
        np.testing.assert_array_equal(actual, expected)
    else:
        assert _relative_error(actual, expected) < 1e-5
