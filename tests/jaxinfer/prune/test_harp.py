"""HARP pruning (`jaxinfer.prune.harp`): the conversion keeps every remaining weight, the
greedy alpha search equals the same search done by brute force through the full forward and
never scores worse than alpha = 1, the paged cache of a HARP model gives the cache-free
perplexity, and bad requests fail with a message."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.perplexity import perplexity
from jaxinfer.prune.harp import calibration_loss, harp_prune, search_alphas, to_harp
from jaxinfer.quant import QuantizationConfig, quantize_model

CONFIG = get_preset("tiny").replace(num_layers=4)
GRID = (0.0, 0.5, 1.0)


@pytest.fixture(scope="module")
def model():
    # Weights 10x the default scale, so that attention matters to the loss and the alphas
    # give clearly different losses.
    model = create_model(CONFIG, seed=6)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, nnx.map_state(lambda _, v: v * 10.0 if v.ndim >= 2 else v, state))
    return model


@pytest.fixture(scope="module")
def windows():
    rng = np.random.default_rng(0)
    return rng.integers(3, 512, size=(6, 24)).astype(np.int32)  # [B, T]


def test_to_harp_keeps_every_remaining_weight_and_leaves_the_model_alone(model):
    harp = to_harp(model, (0.5, 1.0))
    assert harp.config.harp_alphas == (0.5, 1.0) and model.config.harp_alphas == ()
    dense = dict(nnx.to_flat_state(nnx.state(model)))
    pruned = dict(nnx.to_flat_state(nnx.state(harp)))
    assert set(dense) - set(pruned) == {("layers", layer, "attention", projection)
                                        for layer in (2, 3) for projection in ("q_proj",
                                                                               "k_proj")}
    for path, variable in pruned.items():
        np.testing.assert_array_equal(variable.get_value(), dense[path].get_value())
    ids = np.arange(3, 10, dtype=np.int32)[None]  # [1, T]
    assert not np.allclose(harp(ids)[0], model(ids)[0])
    # Changing alphas of a HARP model (and converting more layers) works the same way.
    again = to_harp(harp, (1.0, 0.0, 0.5))
    assert again.config.harp_alphas == (1.0, 0.0, 0.5)
    np.testing.assert_array_equal(again.layers[3].attention.v_proj[...],
                                  model.layers[3].attention.v_proj[...])


def _brute_force_greedy(model, windows) -> tuple[float, ...]:
    """The search's definition, scored by the full forward of whole converted models."""
    alphas = [1.0, 1.0]
    for offset in (1, 0):  # the top layer first
        losses = {}
        for alpha in GRID:
            trial = list(alphas)
            trial[offset] = alpha
            losses[alpha] = calibration_loss(to_harp(model, trial), windows, batch_size=4)
        alphas[offset] = min(GRID, key=lambda alpha: (losses[alpha], alpha != 1.0))
    return tuple(alphas)


@pytest.mark.slow  # 22 s: six whole models compiled for the brute force
def test_search_equals_the_brute_force_greedy_search(model, windows):
    found = search_alphas(model, windows, 2, grid=GRID, batch_size=4, progress=False)
    assert found == _brute_force_greedy(model, windows)
    assert all(0.0 <= alpha <= 1.0 for alpha in found)


def test_searched_alphas_score_no_worse_than_alpha_one(model, windows):
    pruned, alphas = harp_prune(model, windows, 2, batch_size=4, progress=False)
    assert pruned.config.harp_alphas == alphas
    assert all(alpha in {round(0.1 * step, 1) for step in range(11)} for alpha in alphas)
    chosen = calibration_loss(pruned, windows)
    at_one = calibration_loss(to_harp(model, (1.0, 1.0)), windows)
    assert np.exp(chosen) <= np.exp(at_one) * (1 + 1e-5)  # the perplexities
    # On this model the search does find better alphas than 1 (it picks (0.0, 1.0)).
    assert alphas != (1.0, 1.0) and chosen < at_one


def test_given_alphas_skip_the_search(model):
    pruned, alphas = harp_prune(model, None, 2, 1.0)
    assert alphas == (1.0, 1.0) and pruned.config.harp_alphas == (1.0, 1.0)
    assert harp_prune(model, None, 3, (0.0, 0.2, 1.0))[1] == (0.0, 0.2, 1.0)


def test_paged_perplexity_of_a_harp_model_equals_the_cache_free_one(model):
    harp = to_harp(model, (0.3, 0.8))
    ids = np.random.default_rng(3).integers(3, 512, size=70)  # [N]
    paged = perplexity(harp, ids, window=32, batch_size=2, kv_cache_dtype="float32")
    plain = perplexity(harp, ids, window=32, batch_size=2)
    assert paged.nll == pytest.approx(plain.nll, rel=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda m: harp_prune(m, None, 2), "needs calibration windows"),
    (lambda m: harp_prune(m, None, 2, (1.0,)), "1 HARP alphas for 2 layers"),
    (lambda m: harp_prune(m, None, 2, 1.5), r"in \[0, 1\]"),
    (lambda m: harp_prune(m, None, 4, 1.0), "need 1 <= n < num_layers = 4"),
    (lambda m: search_alphas(m, np.zeros((2, 8), np.int32), 1, grid=(2.0,)), "grid"),
    (lambda m: to_harp(quantize_model(m, QuantizationConfig.for_method("rtn", bits=8)),
                       (1.0,)), "float models"),
])
def test_bad_requests_fail_with_a_message(model, call, message):
    with pytest.raises(ValueError, match=message):
        call(model)


def test_a_harp_model_prunes_and_quantizes_with_calibration(model, windows):
    """Wanda and GPTQ calibrate the HARP blocks' v/o too, an alpha-0 block included (it runs
    under the capture hooks and adds exactly zero)."""
    from jaxinfer.prune import PruningConfig, prune_model
    from jaxinfer.quant.gptq import gptq_quantize_model

    harp = to_harp(model, (0.0, 0.7))
    pruned = prune_model(harp, PruningConfig.for_method("wanda", sparsity=0.5), windows,
                         progress=False)
    for layer in (2, 3):
        for projection in ("v_proj", "o_proj"):
            weight = np.asarray(getattr(pruned.layers[layer].attention, projection)[...])
            assert np.mean(weight == 0) == 0.5
    quantized = gptq_quantize_model(
        harp, QuantizationConfig.for_method("gptq", bits=4, group_size=32), windows)
    assert type(quantized.layers[2].attention.o_proj).__name__ == "QuantizedLinear"
    ids = windows[:1]  # [1, T]
    assert np.all(np.isfinite(quantized(ids)[0]))


def test_structured_pruning_of_a_harp_model_says_to_do_it_first(model, windows):
    from jaxinfer.prune.structured import structured_prune

    with pytest.raises(ValueError, match="prune structures first, then convert with HARP"):
        structured_prune(to_harp(model, (1.0,)), "heads=0.5", windows)
