"""GPTQ: against a slow, unblocked textbook implementation; equal to RTN when the Hessian is
the identity; dead inputs; and lower layer output error than RTN on every layer of a model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.quant import QuantizationConfig, WeightScheme, linear_sites
from jaxinfer.quant.gptq import gptq_quantize, gptq_quantize_model, hessian
from jaxinfer.quant.linear import quantize_matrix
from pallas_kernels.quant_matmul import dequantize_weight, reference

INT4_ASYM = WeightScheme(format="int4", bits=4, group_size=16, symmetric=False)
INT3_SYM = WeightScheme(format="int4", bits=3, group_size=16, symmetric=True)
INT8 = WeightScheme(format="int8")


def _textbook_gptq(weight: np.ndarray, h: np.ndarray, scheme: WeightScheme, damping: float,
                   act_order: bool) -> np.ndarray:
    """The obvious O(K^2 N) algorithm: every update applied to every later input at once
    (no blocks), each group's scale taken from the live weights when its first input comes
    up. Returns the dequantized `[K, N]` weight."""
    w = weight.astype(np.float64).T.copy()  # [N, K]
    h = h.astype(np.float64).copy()
    k = w.shape[1]
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    h[np.diag_indices(k)] += damping * np.mean(np.diag(h))
    h_inverse = np.linalg.inv(h)
    # Work in original coordinates: the Cholesky factor of the permuted inverse.
    upper = np.linalg.cholesky(h_inverse[order][:, order]).T  # [K, K] permuted
    group_size = scheme.group_size or k
    parameters = {}
    result = np.zeros_like(w)  # [N, K]
    for position, column in enumerate(order):
        group = column // group_size
        if group not in parameters:
            current = w[:, group * group_size:(group + 1) * group_size].T  # [g, N]
            if scheme.format == "int4":
                scales, zeros = reference.grouped_quantization_parameters(
                    jnp.asarray(current[None], jnp.float32), scheme.bits,
                    symmetric=scheme.symmetric)
                zero = 0.0 if zeros is None else np.asarray(zeros[0], np.float64)
                parameters[group] = (np.asarray(scales[0], np.float64), zero)
            else:
                parameters[group] = (np.max(np.abs(current), axis=0).astype(np.float32)
                                     .astype(np.float64) / 127, 0.0)
        scale, zero = parameters[group]
        lowest, highest = (reference.int4_levels(scheme.bits, scheme.symmetric)
                           if scheme.format == "int4" else (-127, 127))
        quantized = (np.clip(np.round(w[:, column] / scale) + zero, lowest, highest) - zero
                     ) * scale
        result[:, column] = quantized
        error = (w[:, column] - quantized) / upper[position, position]
        later = order[position:]
        w[:, later] -= np.outer(error, upper[position, position:])
    return result.T  # [K, N]


def _problem(seed: int, k: int = 64, n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(k, k)) * 0.3 + np.eye(k)  # correlated inputs
    x = rng.normal(size=(256, k)) @ mixing * rng.uniform(0.2, 3.0, size=k)  # [M, K]
    return rng.normal(size=(k, n)), hessian(x)  # [K, N], [K, K]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("scheme", [INT4_ASYM, INT3_SYM, INT8], ids=["int4a", "int3s", "int8"])
def test_blocked_gptq_equals_the_textbook_algorithm(scheme, act_order):
    weight, h = _problem(0)
    quantized = gptq_quantize(weight, h, scheme, damping=0.01, block_size=8,
                              act_order=act_order)
    expected = _textbook_gptq(weight, h, scheme, 0.01, act_order)  # [K, N]
    np.testing.assert_allclose(dequantize_weight(quantized), expected, rtol=1e-5, atol=1e-6)
    assert quantized.format == scheme.format and quantized.bits == scheme.bits


def test_identity_hessian_gives_round_to_nearest():
    weight, _ = _problem(1)
    for scheme in (INT4_ASYM, INT3_SYM, INT8):
        quantized = gptq_quantize(weight, 3.0 * np.eye(64), scheme, block_size=16)
        expected = quantize_matrix(jnp.asarray(weight, jnp.float32), scheme)
        np.testing.assert_array_equal(quantized.values, expected.values)
        np.testing.assert_allclose(quantized.scales, expected.scales, rtol=1e-6)


def test_dead_inputs_are_zeroed():
    weight, h = _problem(2)
    h[5, :] = h[:, 5] = 0.0
    quantized = gptq_quantize(weight, h, INT4_ASYM, block_size=16)
    assert np.all(np.asarray(dequantize_weight(quantized))[5] == 0.0)


def test_gptq_beats_rtn_on_every_layer_of_a_small_model():
    model = create_model(get_preset("tiny"), seed=0)
    windows = np.random.default_rng(0).integers(3, 512, size=(8, 64))  # [B, T]
    config = QuantizationConfig.for_method("gptq", bits=4, group_size=32, symmetric=False)
    errors = {}

    def on_layer(site, inputs, matrix, weight):
        exact = inputs @ matrix  # [M, N]
        rtn = quantize_matrix(matrix, config.scheme_for(site.path))
        errors[site.path] = (float(jnp.linalg.norm(exact - inputs @ dequantize_weight(weight))),
                             float(jnp.linalg.norm(exact - inputs @ dequantize_weight(rtn))))

    quantized = gptq_quantize_model(model, config, windows, on_layer=on_layer)
    assert len(errors) == 14  # 7 projections x 2 blocks; the LM head stays float
    worse = {path: pair for path, pair in errors.items() if not pair[0] < pair[1]}
    assert not worse, f"GPTQ not better than RTN on {worse}"
    assert all(site.is_quantized for site in linear_sites(quantized)
               if site.path != "lm_head")
