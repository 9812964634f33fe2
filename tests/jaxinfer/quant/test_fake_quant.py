"""Simulated quantization: the quantizers against hand values, and the model-level protocols."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.quant import (
    PROTOCOLS,
    QuantizationProtocol,
    quantize_asymmetric,
    quantize_model_weights,
    quantize_symmetric,
    simulate,
)


def test_symmetric_per_output_channel_by_hand():
    weight = jnp.asarray([[1.0, -0.13], [0.45, 0.2], [-0.26, 0.05]])  # [in 3, out 2]
    # 4 bits: 7 levels a side; column 0 scale 1/7, column 1 scale 0.2/7.
    dequantized = np.asarray(quantize_symmetric(weight, 4, reduce_axes=(0,)))
    expected = np.stack([np.round(np.asarray(weight[:, 0]) * 7) / 7,
                         np.round(np.asarray(weight[:, 1]) / 0.2 * 7) * 0.2 / 7], axis=1)
    np.testing.assert_allclose(dequantized, expected, atol=1e-6)


def test_clip_search_never_increases_the_error():
    weight = jax.random.normal(jax.random.key(0), (64, 32)).at[3, :].mul(8.0)  # outlier row
    plain = quantize_symmetric(weight, 4, (0,))
    searched = quantize_symmetric(weight, 4, (0,), clip_search=True)
    error = lambda q: np.sum(np.square(np.asarray(q - weight)), axis=0)  # noqa: E731
    assert np.all(error(searched) <= error(plain) + 1e-6)
    assert np.sum(error(searched)) < np.sum(error(plain))


def test_asymmetric_per_token_and_groups():
    x = jnp.asarray([[[0.0, 1.0, 2.0, 3.0]]])  # [1, 1, 4]: exactly representable at 2 bits
    np.testing.assert_allclose(np.asarray(quantize_asymmetric(x, 2)), np.asarray(x), atol=1e-6)
    tokens = jax.random.normal(jax.random.key(1), (2, 3, 4, 64))  # [B, T, K, H]
    dequantized = quantize_asymmetric(tokens, 4, group_size=128)
    assert dequantized.shape == tokens.shape
    groups = np.asarray(tokens).reshape(2, 3, 2, 128)
    step = (groups.max(-1) - groups.min(-1)) / 15  # one rounding step per group
    error = np.abs(np.asarray(dequantized - tokens)).reshape(2, 3, 2, 128).max(-1)
    assert np.all(error <= step / 2 + 1e-5)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_asymmetric(jnp.ones((1, 1, 12)), 4, group_size=8)


def test_weight_quantization_touches_only_block_linears():
    model = create_model(get_preset("tiny"), seed=0)
    quantized = quantize_model_weights(model, 4)
    assert np.array_equal(np.asarray(quantized.embed.weight[...]),
                          np.asarray(model.embed.weight[...]))
    assert np.array_equal(np.asarray(quantized.final_norm.weight[...]),
                          np.asarray(model.final_norm.weight[...]))
    q_proj = np.asarray(quantized.layers[0].attention.q_proj[...])  # [D, N, H]
    # 4 bits: at most 15 distinct values per output channel (an (n, h) pair).
    assert max(len(np.unique(q_proj[:, n, h])) for n in range(2) for h in range(4)) <= 15


def test_protocols_degrade_gracefully_and_in_order():
    model = create_model(get_preset("tiny"), seed=0)
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, model.config.vocab_size)
    reference, _ = model(tokens)  # [B, T, V]
    errors = {}
    for name in ("W8A8", "W4A4KV4"):
        with simulate(model, PROTOCOLS[name]) as quantized:
            logits, _ = jax.jit(lambda ids, m=quantized: m(ids)[0])(tokens)
        errors[name] = float(jnp.linalg.norm(logits - reference) / jnp.linalg.norm(reference))
    assert 0 < errors["W8A8"] < errors["W4A4KV4"] < 1.0, errors
    # Outside the context the hooks are gone: the plain forward is exact again.
    again, _ = model(tokens)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(reference))


def test_full_precision_protocol_is_the_identity():
    model = create_model(get_preset("tiny"), seed=0)
    tokens = jax.random.randint(jax.random.key(3), (1, 8), 0, model.config.vocab_size)
    with simulate(model, QuantizationProtocol("fp")) as same:
        np.testing.assert_array_equal(np.asarray(same(tokens)[0]), np.asarray(model(tokens)[0]))
