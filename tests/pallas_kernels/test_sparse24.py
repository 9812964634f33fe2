"""Compressed 2:4 sparse weights: compression is exact, the layout's bytes are as stated, a
weight that is not 2:4 is refused, and the kernel (interpret mode) and the XLA path equal
the dense matmul of the same weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant_matmul import (
    dequantize_weight,
    quantize_weight,
    quantized_matmul,
    sparse24,
    sparse24_kernel,
)
from tests.pallas_kernels.interpret import INTERPRET


def _sparse_weight(k: int, n: int, seed: int = 0) -> jax.Array:
    """A random `[k, n]` float32 weight pruned to 2:4 (the 2 largest |w| of every 4 inputs)."""
    w = jax.random.normal(jax.random.key(seed), (k, n))  # [K, N]
    return sparse24.prune_2_4(w)


def _dense_equivalent(w: jax.Array, weight_format: str, group_size: int) -> jax.Array:
    """The dense `[K, N]` float32 matrix a sparse format must stand for: the weight itself,
    rounded like the dense format of the same values would round it."""
    if weight_format == "sparse24_int8":
        return dequantize_weight(quantize_weight(w, "int8"))
    if weight_format == "sparse24_int4":
        return dequantize_weight(quantize_weight(w, "int4", group_size=group_size))
    return w


def test_prune_keeps_the_two_largest_of_every_four_inputs():
    w = jnp.array([[1.0, -5.0], [-3.0, 0.5], [2.0, 4.0], [0.0, -0.25],
                   [0.0, 0.0], [7.0, 0.0], [0.0, 0.0], [0.0, 1.0]])  # [8, 2]
    expected = jnp.array([[0.0, -5.0], [-3.0, 0.0], [2.0, 4.0], [0.0, 0.0],
                          [0.0, 0.0], [7.0, 0.0], [0.0, 0.0], [0.0, 1.0]])  # [8, 2]
    np.testing.assert_array_equal(sparse24.prune_2_4(w), expected)


def test_positions_pack_and_unpack_exactly():
    w = _sparse_weight(64, 128)
    positions = sparse24.kept_positions(w)  # [16, 2, 128]
    assert bool(jnp.all(positions[:, 0] < positions[:, 1]))
    packed = sparse24.pack_positions(positions)  # [8, 128]
    assert packed.shape == (8, 128) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(sparse24.unpack_positions(packed), positions)
    # Group 0 sits in the low nibble of byte 0, group 8 (first of the second half) in its high.
    byte = int(packed[0, 0])
    assert byte & 0xF == int(positions[0, 0, 0]) | int(positions[0, 1, 0]) << 2
    assert byte >> 4 == int(positions[8, 0, 0]) | int(positions[8, 1, 0]) << 2


@pytest.mark.parametrize(("weight_format", "bits", "group_size"), [
    ("sparse24", 32, None), ("sparse24", 16, None), ("sparse24_int8", 8, None),
    ("sparse24_int4", 4, 32), ("sparse24_int4", 3, 64)])
def test_compress_then_dequantize_is_exact(weight_format, bits, group_size):
    w = _sparse_weight(128, 256, seed=1)
    if bits == 16:
        w = w.astype(jnp.bfloat16)
    weight = quantize_weight(w, weight_format, bits=bits, group_size=group_size or 128)
    assert weight.shape == (128, 256) and weight.bits == bits
    if weight_format == "sparse24_int4":
        expected = dequantize_weight(quantize_weight(w, "int4", group_size=group_size,
                                                     bits=bits))  # [K, N]
    else:
        expected = _dense_equivalent(w, weight_format, 0).astype(jnp.float32)  # [K, N]
    np.testing.assert_array_equal(dequantize_weight(weight), expected)


def test_a_weight_that_is_not_2_4_is_refused_naming_the_group():
    w = np.array(_sparse_weight(64, 16, seed=2))  # [64, 16]
    w[20:24, 7] = [1.0, 2.0, 3.0, 0.0]  # group 5 of column 7: 3 non-zeros
    for weight_format in ("sparse24", "sparse24_int8", "sparse24_int4"):
        with pytest.raises(ValueError, match=r"input rows 20\.\.23 of output column 7 "
                                             r"\(group 5\) hold 3 non-zeros"):
            quantize_weight(jnp.asarray(w), weight_format, group_size=32)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_weight(jnp.zeros((24, 16)), "sparse24")


def test_bytes_per_parameter():
    k, n = 4096, 14336  # Llama's MLP

    def stored_bytes(weight_format: str, **options) -> int:
        shapes = jax.eval_shape(lambda w: quantize_weight(w, weight_format, **options),
                                jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))

    bf16 = 2 * k * n
    # Kept bf16 values (1 byte per parameter) and 4 bits of positions per 4 parameters.
    assert stored_bytes("sparse24") == 1.125 * k * n
    assert stored_bytes("sparse24") / bf16 == 0.5625
    # int8 values (0.5), positions (0.125) and a float32 scale per output column.
    assert stored_bytes("sparse24_int8") == 0.625 * k * n + 4 * n
    # Nibble-packed int4 values (0.25), positions, a float32 scale per 128 rows per column.
    sparse_int4 = stored_bytes("sparse24_int4", group_size=128)
    assert sparse_int4 == 0.375 * k * n + 4 * n * k // 128
    # With its scales: 0.40625 bytes per parameter, 0.203x of bf16, 0.765x of dense int4
    # (0.53125: the scales do not shrink, they still cover every 128 rows).
    assert sparse_int4 / bf16 == 0.203125
    assert sparse_int4 / stored_bytes("int4", group_size=128) == 0.40625 / 0.53125


# (weight format, bits, group size, K, N, M, explicit blocks): several shapes, a ragged M,
# and blocks that split I into several steps and O into several columns of blocks.
MATMUL_CASES = [
    ("sparse24", 32, None, 64, 128, 3, {}),
    ("sparse24", 16, None, 256, 256, 17, dict(block_groups=8, block_n=128, block_m=8)),
    ("sparse24_int8", 8, None, 128, 384, 8, {}),
    ("sparse24_int8", 8, None, 512, 128, 5, dict(block_groups=16)),
    ("sparse24_int4", 4, 32, 256, 128, 9, dict(block_groups=16, block_m=8)),
    ("sparse24_int4", 4, 64, 128, 256, 2, {}),
]


@pytest.mark.parametrize(("weight_format", "bits", "group_size", "k", "n", "m", "blocks"),
                         MATMUL_CASES)
def test_compressed_matmul_equals_the_dense_matmul(weight_format, bits, group_size, k, n, m,
                                                   blocks):
    w = _sparse_weight(k, n, seed=k + n)
    weight = quantize_weight(w, weight_format, bits=bits, group_size=group_size or 128)
    dense = _dense_equivalent(w, weight_format, group_size).astype(
        jnp.bfloat16 if bits == 16 else jnp.float32).astype(jnp.float32)  # [K, N]
    x = jax.random.normal(jax.random.key(3), (m, k))  # [M, K]
    expected = np.asarray(jnp.matmul(x, dense, precision=jax.lax.Precision.HIGHEST))  # [M, N]
    tolerance = 1e-5 * float(np.max(np.abs(expected)))
    xla = quantized_matmul(x, weight, implementation="xla")  # [M, N]
    np.testing.assert_allclose(np.asarray(xla), expected, atol=tolerance)
    kind = {"sparse24": "float", "sparse24_int8": "int8", "sparse24_int4": "int4"}[weight_format]
    kernel = sparse24_kernel.sparse24_matmul(
        x, weight.values, weight.positions, weight.scales, kind=kind, group_size=group_size,
        interpret=INTERPRET, **blocks)  # [M, N]
    assert kernel.shape == (m, n) and kernel.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(kernel), expected, atol=tolerance)


def test_kernel_refuses_blocks_that_do_not_divide_the_weight():
    w = _sparse_weight(256, 128)
    weight = quantize_weight(w, "sparse24")
    x = jnp.ones((4, 256))  # [M, K]
    with pytest.raises(ValueError, match="block_groups=12 must divide"):
        sparse24_kernel.sparse24_matmul(x, weight.values, weight.positions, kind="float",
                                        block_groups=12, interpret=INTERPRET)
    int4 = quantize_weight(w, "sparse24_int4", group_size=128)
    with pytest.raises(ValueError, match="group_size=128 must be a multiple of 4 dividing"):
        sparse24_kernel.sparse24_matmul(x, int4.values, int4.positions, int4.scales,
                                        kind="int4", group_size=128, block_groups=16,
                                        interpret=INTERPRET)
