"""SmoothQuant: factors by hand, smoothing leaves the float model's function unchanged, and
on a model with an activation-outlier channel W8A8 with smoothing beats W8A8 without."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.quant import QuantizationConfig, QuantizationRule, WeightScheme, quantize_model
from jaxinfer.quant.smoothquant import smooth_model, smoothing_factors, smoothquant_model


def test_factors_by_hand():
    factors = smoothing_factors(jnp.asarray([16.0, 1.0, 0.0]), jnp.asarray([1.0, 4.0, 1.0]),
                                alpha=0.5)
    np.testing.assert_allclose(factors, [4.0, 0.5, np.sqrt(1e-5)], rtol=1e-5)
    np.testing.assert_allclose(smoothing_factors(jnp.asarray([8.0]), jnp.asarray([2.0]), 1.0),
                               [8.0])


@pytest.fixture(scope="module")
def outlier_model():
    """The tiny model with one input channel of the first block's norms made 40x larger:
    the activation outlier SmoothQuant is for."""
    model = create_model(get_preset("tiny"), seed=0)
    for norm in (model.layers[0].input_norm, model.layers[0].post_attention_norm):
        norm.weight[...] = norm.weight[...].at[7].set(40.0)
    return model


def test_smoothing_preserves_the_float_model(outlier_model):
    windows = np.random.default_rng(0).integers(3, 512, size=(4, 32))  # [B, T]
    smoothed = smooth_model(outlier_model, windows, alpha=0.5)
    gain = smoothed.layers[0].input_norm.weight[...]
    assert float(gain[7]) < 40.0  # the outlier moved into the weights
    assert float(outlier_model.layers[0].input_norm.weight[...][7]) == 40.0  # copy untouched
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 512)
    expected, _ = outlier_model(tokens)
    actual, _ = smoothed(tokens)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


def test_smoothing_lowers_the_w8a8_error_on_an_outlier_channel(outlier_model):
    windows = np.random.default_rng(0).integers(3, 512, size=(4, 32))  # [B, T]
    w8a8 = QuantizationRule(r".", WeightScheme(format="w8a8"))
    plain = quantize_model(outlier_model, QuantizationConfig(method="rtn", rules=(w8a8,)))
    smooth = smoothquant_model(outlier_model, QuantizationConfig(
        method="smoothquant", rules=(w8a8,), smoothquant_alpha=0.5), windows)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 512)
    exact, _ = outlier_model(tokens)
    plain_error = float(jnp.linalg.norm(plain(tokens)[0] - exact))
    smooth_error = float(jnp.linalg.norm(smooth(tokens)[0] - exact))
    assert smooth_error < 0.7 * plain_error, (smooth_error, plain_error)
