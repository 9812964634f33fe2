"""The weight-format registry: every registered format, whatever its name, is checked the same
way: its kernel matmul (interpret mode) equals its reference matmul, its quantizer lands
within half a step of the float weight (of an integer grid times the scale, or of a scaled
floating-point grid), and its integer levels pack and unpack exactly. A
format that holds only 2:4 sparse weights is given one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant_matmul import (
    dequantize_weight,
    get_format,
    quantize_weight,
    quantized_matmul,
    registered_formats,
    sparse24,
)
from tests.pallas_kernels.interpret import INTERPRET

K, N, M = 256, 128, 40
GROUP_SIZE = 32


def _cases() -> list[tuple[str, int, bool]]:
    """(format, bits, symmetric) for every registered format, bit width and symmetry."""
    cases = []
    for name in registered_formats():
        weight_format = get_format(name)
        for bits in weight_format.bits:
            for symmetric in (True, False) if weight_format.zero_points else (True,):
                cases.append((name, bits, symmetric))
    return cases


CASES = _cases()


def _weight(name: str, bits: int, symmetric: bool, seed: int):
    w = jax.random.normal(jax.random.key(seed), (K, N)) + (0.0 if symmetric else 0.5)
    if get_format(name).sparse_2_4:  # such formats refuse other weights
        w = sparse24.prune_2_4(w)
    return w, quantize_weight(w, name, group_size=GROUP_SIZE, symmetric=symmetric, bits=bits)


def test_the_built_in_formats_are_registered():
    assert {"int8", "int4", "w8a8"} <= set(registered_formats())
    with pytest.raises(ValueError, match="unknown weight format 'fp7'"):
        get_format("fp7")


@pytest.mark.parametrize(("name", "bits", "symmetric"), CASES)
def test_kernel_matmul_equals_reference_matmul(name, bits, symmetric):
    weight_format = get_format(name)
    _, weight = _weight(name, bits, symmetric, 0)
    x = jax.random.normal(jax.random.key(1), (M, K))  # [M, K]
    expected = weight_format.reference_matmul(x, weight, jnp.float32)  # [M, N]
    actual = weight_format.kernel_matmul(x, weight, jnp.float32, INTERPRET)  # [M, N]
    assert actual.shape == expected.shape == (M, N)
    scale = float(np.max(np.abs(np.asarray(expected))))
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=1e-5 * scale)
    # The public op reaches the same two functions through the registry.
    np.testing.assert_array_equal(quantized_matmul(x, weight, implementation="xla"), expected)


@pytest.mark.parametrize(("name", "bits", "symmetric"), CASES)
def test_quantize_lands_within_half_a_step(name, bits, symmetric):
    w, weight = _weight(name, bits, symmetric, 2)
    assert weight.format == name and weight.bits == bits and weight.shape == (K, N)
    dequantized = dequantize_weight(weight)  # [K, N]
    assert dequantized.shape == (K, N)
    if weight.scales is None:  # float values: only their own dtype's rounding
        np.testing.assert_array_equal(dequantized, w.astype(weight.values.dtype))
        return
    rows = get_format(name).group_rows(K, weight.group_size)
    scales = jnp.broadcast_to(jnp.reshape(weight.scales, (-1, 1, N)),
                              (K // rows, rows, N)).reshape(K, N)  # [K, N] per element
    if jnp.issubdtype(weight.values.dtype, jnp.floating):
        # A scaled floating-point grid (fp8): half a unit in the last place of the scaled
        # value, or half the smallest subnormal below the normal range.
        info = jnp.finfo(weight.values.dtype)
        half_step = (jnp.abs(w) / scales * 2.0 ** -(info.nmant + 1)
                     + float(info.smallest_subnormal) / 2)  # [K, N], in scaled units
        assert bool(jnp.all(jnp.abs(dequantized - w) <= scales * half_step * (1 + 1e-5)))
        return
    # Clipping to the grid can exceed half a step only where the grid is asymmetric about
    # the range, so compare against one step there.
    slack = 0.5 if symmetric else 1.0
    assert bool(jnp.all(jnp.abs(dequantized - w) <= scales * (slack + 1e-5)))


@pytest.mark.parametrize(("name", "bits", "symmetric"), CASES)
def test_levels_pack_and_unpack_exactly(name, bits, symmetric):
    weight_format = get_format(name)
    if weight_format.levels is None:
        pytest.skip(f"{name} has no integer levels (GPTQ cannot target it)")
    lowest, highest = weight_format.levels(bits, symmetric)
    levels = jax.random.randint(jax.random.key(3), (K, N), lowest, highest + 1
                                ).astype(jnp.int8)  # [K, N]
    rows = weight_format.group_rows(K, GROUP_SIZE if weight_format.grouped else None)
    groups = K // rows
    scales = jax.random.uniform(jax.random.key(4), (groups, N), minval=0.01, maxval=0.1)
    zeros = None if symmetric else jax.random.randint(
        jax.random.key(5), (groups, N), lowest, highest + 1).astype(jnp.int8)  # [G, N]
    weight = weight_format.from_levels(levels, scales, zeros,
                                       GROUP_SIZE if weight_format.grouped else None, bits)
    assert weight.shape == (K, N)
    shift = 0.0 if zeros is None else zeros.astype(jnp.float32)[:, None]
    expected = ((levels.astype(jnp.float32).reshape(groups, rows, N) - shift)
                * scales[:, None]).reshape(K, N)  # [K, N]
    np.testing.assert_array_equal(dequantize_weight(weight), expected)
