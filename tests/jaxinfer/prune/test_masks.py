"""Magnitude and Wanda masks: exact sparsity per output, exact N:M, the largest |W| kept,
and Wanda's choice equal to a slow reference of its score."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.prune import PruningScheme, input_norms, keep_mask, magnitude_scores
from jaxinfer.prune.masks import prune_matrix


def _weight(seed: int, k: int = 64, n: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(k, n))  # [I, O]


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.7])
def test_unstructured_mask_has_the_sparsity_in_every_output(sparsity):
    mask = keep_mask(magnitude_scores(_weight(0)), sparsity=sparsity)  # [I, O]
    zeros_per_output = np.sum(~mask, axis=0)  # [O]
    assert np.all(zeros_per_output == round(sparsity * 64))


@pytest.mark.parametrize("pattern", [(2, 4), (4, 8), (1, 4)])
def test_n_m_mask_zeroes_n_of_every_m_consecutive_inputs(pattern):
    n, m = pattern
    mask = keep_mask(magnitude_scores(_weight(1)), pattern=pattern)  # [I, O]
    zeros = np.sum(~mask.reshape(64 // m, m, 24), axis=1)  # [I / M, O]
    assert np.all(zeros == n)


def test_n_m_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of M=8"):
        keep_mask(np.ones((12, 3)), pattern=(4, 8))


def test_magnitude_keeps_the_largest_weights_of_each_output():
    weight = _weight(2)
    pruned = prune_matrix(weight, PruningScheme(method="magnitude", sparsity=0.5))  # [I, O]
    for column in range(weight.shape[1]):
        kept = np.abs(weight[pruned[:, column] != 0, column])
        dropped = np.abs(weight[pruned[:, column] == 0, column])
        assert kept.size == dropped.size == 32
        assert kept.min() > dropped.max()
        np.testing.assert_array_equal(pruned[pruned[:, column] != 0, column],
                                      weight[pruned[:, column] != 0, column])


def _slow_wanda(weight: np.ndarray, inputs: np.ndarray, count: int) -> np.ndarray:
    """Wanda from its definition with loops: per output j, S_ij = |W_ij| * ||X_i||_2 over
    the tokens; the `count` lowest of each output zeroed. Returns the `[I, O]` keep mask."""
    k, n = weight.shape
    mask = np.ones((k, n), bool)
    for j in range(n):
        scores = []
        for i in range(k):
            norm = np.sqrt(sum(float(inputs[t, i]) ** 2 for t in range(inputs.shape[0])))
            scores.append((abs(weight[i, j]) * norm, i))
        for _, i in sorted(scores)[:count]:
            mask[i, j] = False
    return mask


def test_wanda_equals_a_slow_reference_and_differs_from_magnitude():
    rng = np.random.default_rng(3)
    weight = _weight(3, k=32, n=8)
    # Input features of very different sizes, so the activation term changes the choice.
    inputs = rng.normal(size=(40, 32)) * rng.uniform(0.05, 5.0, size=32)  # [T, I]
    scheme = PruningScheme(method="wanda", sparsity=0.5)
    pruned = prune_matrix(weight, scheme, input_norms(inputs))  # [I, O]
    expected = _slow_wanda(weight, inputs, 16)
    np.testing.assert_array_equal(pruned != 0, expected)
    magnitude = prune_matrix(weight, PruningScheme(method="magnitude", sparsity=0.5))
    assert np.any((magnitude != 0) != expected)


def test_wanda_n_m_picks_by_the_score_within_each_group():
    rng = np.random.default_rng(4)
    weight = _weight(4, k=16, n=4)
    inputs = rng.normal(size=(10, 16)) * rng.uniform(0.1, 4.0, size=16)  # [T, I]
    pruned = prune_matrix(weight, PruningScheme(method="wanda", pattern=(2, 4)),
                          input_norms(inputs))
    scores = np.abs(weight) * np.linalg.norm(inputs, axis=0)[:, None]  # [I, O]
    for group in range(4):
        rows = slice(4 * group, 4 * group + 4)
        for column in range(4):
            lowest = set(np.argsort(scores[rows, column])[:2])
            assert {i for i in range(4) if pruned[rows, column][i] == 0} == lowest


def test_wanda_without_norms_is_refused():
    with pytest.raises(ValueError, match="input norms"):
        prune_matrix(_weight(5), PruningScheme(method="wanda", sparsity=0.5))
