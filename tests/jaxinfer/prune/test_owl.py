"""OWL: outlier ratios from Wanda scores, offsets with mean 0 within lambda, more outliers
pruned less, and per-layer sparsities in a pruned model whose mean is the target."""

from __future__ import annotations

import numpy as np

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.prune import PruningConfig, layer_offsets, outlier_ratios, owl_offsets, prune_model
from jaxinfer.prune.masks import input_norms, wanda_scores
from jaxinfer.quant import linear_sites
from jaxinfer.quant.calibration import INPUT_SITE, collect_block_inputs


def test_offsets_have_mean_zero_stay_within_lambda_and_favour_outliers():
    ratios = np.array([0.01, 0.05, 0.02, 0.002, 0.03])
    offsets = layer_offsets(ratios, 0.08)
    assert abs(np.mean(offsets)) < 1e-15
    assert np.max(np.abs(offsets)) <= 0.08 + 1e-12
    assert np.argmin(offsets) == np.argmax(ratios)  # most outliers: pruned least
    assert np.argmax(offsets) == np.argmin(ratios)
    np.testing.assert_array_equal(np.argsort(offsets), np.argsort(-ratios))
    assert np.all(layer_offsets(np.full(4, 0.02), 0.08) == 0.0)


def test_outlier_ratios_count_scores_above_m_times_the_layer_mean():
    model = create_model(get_preset("tiny"), seed=0)
    windows = np.random.default_rng(0).integers(3, 512, size=(4, 32))  # [B, T]
    config = PruningConfig.for_method("wanda", sparsity=0.5, owl=True)
    ratios = outlier_ratios(model, config, windows, threshold=3.0)
    per_block = collect_block_inputs(model, windows)
    for index in range(len(model.layers)):
        scores = []
        for site in linear_sites(model):
            if site.path.startswith(f"layers.{index}."):
                norms = input_norms(per_block[index][INPUT_SITE[site.name]])
                scores.append(wanda_scores(site.float_matrix(), norms).ravel())
        scores = np.concatenate(scores)
        expected = np.count_nonzero(scores > 3.0 * scores.mean()) / scores.size
        assert ratios[index] == expected and 0.0 < expected < 0.1


def test_owl_layer_sparsities_average_to_the_target():
    model = create_model(get_preset("tiny").replace(num_layers=4), seed=1)
    windows = np.random.default_rng(1).integers(3, 512, size=(4, 32))  # [B, T]
    pruning = PruningConfig.for_method("wanda", sparsity=0.5, owl=True, owl_lambda=0.1)
    targets = 0.5 + owl_offsets(model, pruning, windows)  # [L]
    assert abs(np.mean(targets) - 0.5) < 1e-12 and np.max(np.abs(targets - 0.5)) <= 0.1 + 1e-12
    pruned = prune_model(model, pruning, windows, progress=False)
    layers = len(model.layers)
    per_layer = np.zeros(layers)
    for index in range(layers):
        zeros = total = 0
        for site in linear_sites(pruned):
            if site.path.startswith(f"layers.{index}."):
                matrix = np.asarray(site.float_matrix())  # [I, O]
                # Every output of every weight of a layer has the layer's sparsity.
                per_output = np.mean(matrix == 0, axis=0)  # [O]
                assert np.ptp(per_output) == 0
                zeros, total = zeros + np.sum(matrix == 0), total + matrix.size
        per_layer[index] = zeros / total
    # Each layer is within rounding (one input of 64 or 128) of 0.5 + its offset; the
    # offsets are not all zero and average to 0, so the mean sparsity is the target.
    assert np.ptp(per_layer) > 0.05
    assert np.all(np.abs(per_layer - targets) <= 1 / 128)
    assert abs(np.mean(per_layer) - 0.5) <= 1 / 64
