"""The excess-kurtosis metric against hand-computed values, and its two labelled variants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from train_distill.outliers import excess_kurtosis, outlier_statistics


def test_excess_kurtosis_matches_a_hand_computed_vector():
    # x = (4, 0, 0, 0): mean(x^4) = 256 / 4 = 64; mean 1, unbiased variance
    # ((3^2) + 3 * 1^2) / 3 = 4, so std^4 = 16 and k = 64 / 16 - 3 = 1.
    assert float(excess_kurtosis(jnp.asarray([4.0, 0.0, 0.0, 0.0]))) == pytest.approx(1.0)
    # One spike among D - 1 zeros: the same algebra with D = 100.
    spike = np.zeros(100, np.float32)
    spike[7] = 5.0
    fourth = 5.0 ** 4 / 100
    variance = np.var(spike, ddof=1)
    assert float(excess_kurtosis(jnp.asarray(spike))) == pytest.approx(
        fourth / variance ** 2 - 3, rel=1e-5)


def test_excess_kurtosis_is_clamped_at_zero_and_batched():
    flat = jnp.asarray([[1.0, -1.0, 1.0, -1.0], [2.0, 0.0, 0.0, 0.0]])  # [2, 4]
    values = np.asarray(excess_kurtosis(flat))  # [2]
    # Row 0: mean(x^4) = 1, unbiased variance 4/3 -> 1 / (16/9) - 3 < 0 -> 0.
    assert values[0] == 0.0
    assert values[1] == pytest.approx(1.0)


def test_gaussian_vectors_score_near_zero():
    x = jax.random.normal(jax.random.key(0), (256, 4096))
    assert float(jnp.mean(excess_kurtosis(x))) < 0.2


def test_outlier_statistics_cover_every_hidden_state_in_both_variants():
    model = create_model(get_preset("tiny"), seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, model.config.vocab_size)
    in_context = outlier_statistics(model, tokens, "in_context")
    length_one = outlier_statistics(model, tokens, "length_one")
    states = model.config.num_layers + 2
    for result in (in_context, length_one):
        assert len(result["kurtosis_per_state"]) == states
        assert len(result["max_over_rms_per_state"]) == states
        assert all(value >= 1.0 for value in result["max_over_rms_per_state"])
    # The embedding output does not depend on context: both variants agree on it exactly.
    assert in_context["kurtosis_per_state"][0] == pytest.approx(
        length_one["kurtosis_per_state"][0], rel=1e-5)
    assert in_context["variant"] == "in_context" and length_one["variant"] == "length_one"
    with pytest.raises(ValueError, match="variant"):
        outlier_statistics(model, tokens, "per_token")
