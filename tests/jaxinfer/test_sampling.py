"""Sampling filters on hand-worked distributions, and the greedy/sampled switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling import filter_logits, sample

PROBABILITIES = np.array([0.05, 0.4, 0.1, 0.3, 0.15], np.float32)
LOGITS = jnp.log(jnp.asarray(PROBABILITIES))[None, :]  # [1, 5]


def _kept(temperature=1.0, top_k=0, top_p=1.0) -> list[int]:
    filtered = filter_logits(LOGITS, jnp.array([temperature]), jnp.array([top_k]),
                             jnp.array([top_p]))
    return [int(i) for i in np.flatnonzero(np.isfinite(np.asarray(filtered[0])))]


def test_top_k_keeps_the_k_most_likely():
    assert _kept(top_k=1) == [1]
    assert _kept(top_k=3) == [1, 3, 4]
    assert _kept(top_k=0) == [0, 1, 2, 3, 4]
    assert _kept(top_k=99) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_nucleus():
    # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05; cumulative 0.4, 0.7, 0.85, 0.95, 1.0.
    assert _kept(top_p=0.3) == [1]
    assert _kept(top_p=0.4) == [1]
    assert _kept(top_p=0.41) == [1, 3]
    assert _kept(top_p=0.8) == [1, 3, 4]
    assert _kept(top_p=1.0) == [0, 1, 2, 3, 4]


def test_top_p_after_top_k_renormalizes():
    # top-k 2 leaves 0.4 and 0.3, i.e. 4/7 and 3/7: top-p 0.5 keeps only the first.
    assert _kept(top_k=2, top_p=0.5) == [1]
    assert _kept(top_k=2, top_p=0.6) == [1, 3]


def test_temperature_scales_logits():
    filtered = filter_logits(LOGITS, jnp.array([0.5]), jnp.array([0]), jnp.array([1.0]))
    np.testing.assert_allclose(filtered, LOGITS / 0.5, rtol=1e-6)


def test_greedy_rows_take_argmax_and_sampled_rows_follow_distribution():
    draws = 20000
    logits = jnp.tile(LOGITS, (draws, 1))  # [R, 5]
    keys = jax.random.split(jax.random.key(0), draws)  # [R]
    greedy = sample(logits, keys, jnp.zeros(draws), jnp.zeros(draws, jnp.int32),
                    jnp.ones(draws))
    assert (np.asarray(greedy) == 1).all()
    sampled = sample(logits, keys, jnp.ones(draws), jnp.zeros(draws, jnp.int32), jnp.ones(draws))
    frequencies = np.bincount(np.asarray(sampled), minlength=5) / draws
    np.testing.assert_allclose(frequencies, PROBABILITIES, atol=0.015)
    # top-k 2 at temperature 1: only the two most likely, renormalized (4/7 and 3/7).
    top2 = sample(logits, keys, jnp.ones(draws), jnp.full(draws, 2), jnp.ones(draws))
    frequencies = np.bincount(np.asarray(top2), minlength=5) / draws
    np.testing.assert_allclose(frequencies, [0, 4 / 7, 0, 3 / 7, 0], atol=0.015)


def test_same_key_same_token():
    keys = jax.random.split(jax.random.key(7), 3)
    logits = jax.random.normal(jax.random.key(1), (3, 50))
    args = (jnp.full(3, 0.9), jnp.full(3, 10), jnp.full(3, 0.9))
    first = sample(logits, keys, *args)
    np.testing.assert_array_equal(first, sample(logits, keys, *args))
