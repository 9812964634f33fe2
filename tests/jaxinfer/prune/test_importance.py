"""Importance of KV groups, MLP channels and layers: both estimators find the structures a
constructed model makes unimportant, and neither depends on how the windows are batched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.models.scan import stack_layers
from jaxinfer.prune.importance import (
    IMPORTANCE_KINDS,
    check_prunable,
    next_token_loss,
    structure_importance,
)
from jaxinfer.prune.structured import StructuredPruning, plan_pruning

CONFIG = get_preset("tiny").replace(num_layers=4, num_heads=8, num_kv_heads=4)


@pytest.fixture(scope="module")
def windows() -> np.ndarray:
    return np.random.default_rng(0).integers(3, CONFIG.vocab_size, (4, 24)).astype(np.int32)


@pytest.mark.parametrize("importance", IMPORTANCE_KINDS)
def test_importance_finds_structures_made_unimportant(importance, windows):
    model = create_model(CONFIG, seed=6)
    weak_group, weak_channel, weak_layer = 2, 37, 1
    tiny = 1e-3
    for index, block in enumerate(model.layers):
        attention, mlp = block.attention, block.mlp
        heads = np.arange(CONFIG.num_heads) // CONFIG.group_size == weak_group  # [N]
        # The group's values and its query heads' o_proj rows near zero: its heads' outputs
        # (activation) and their effect on the loss (Taylor) vanish.
        attention.v_proj[...] = attention.v_proj[...].at[:, weak_group].multiply(tiny)
        attention.o_proj[...] = attention.o_proj[...].at[heads].multiply(tiny)
        mlp.gate_proj[...] = mlp.gate_proj[...].at[:, weak_channel].multiply(tiny)
        mlp.down_proj[...] = mlp.down_proj[...].at[weak_channel].multiply(tiny)
        if index == weak_layer:  # the whole block writes almost nothing to the stream
            attention.o_proj[...] = attention.o_proj[...] * tiny
            mlp.down_proj[...] = mlp.down_proj[...] * tiny
    scores = structure_importance(model, windows, importance)
    assert scores.kv_groups.shape == (4, 4) and scores.channels.shape == (4, 128)
    assert (scores.kv_groups.argmin(axis=1) == weak_group).all(), scores.kv_groups
    assert (scores.channels.argmin(axis=1) == weak_channel).all()
    assert scores.layers.argmin() == weak_layer, scores.layers
    plan = plan_pruning(CONFIG, scores, StructuredPruning(heads=0.25, mlp=0.01, layers=1))
    assert all(weak_group not in kept and len(kept) == 3 for kept in plan.kv_groups)
    assert all(weak_channel not in kept and len(kept) == 127 for kept in plan.channels)
    assert plan.layers == (0, 2, 3)


@pytest.mark.parametrize("importance", IMPORTANCE_KINDS)
def test_scores_do_not_depend_on_the_batch_size(importance, windows):
    model = create_model(CONFIG, seed=2)
    whole = structure_importance(model, windows, importance, batch_size=4)
    for batch_size in (1, 3):  # equal batches, and a short last one
        split = structure_importance(model, windows, importance, batch_size=batch_size)
        for ours, reference in zip(split, whole):
            np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-7)
    assert (whole.kv_groups > 0).all() and (whole.channels > 0).all()
    assert (whole.layers > 0).all()


def test_moe_and_stacked_models_are_refused():
    with pytest.raises(ValueError, match="mixture of experts"):
        check_prunable(create_model(get_preset("tiny-moe")))
    stacked = stack_layers(create_model(CONFIG))
    with pytest.raises(ValueError, match="unstacked"):
        check_prunable(stacked)


def test_taylor_scores_sum_each_structures_own_weights(windows):
    """Taylor scores against |w * dL/dw| summed by explicit indexing of the weights each
    structure owns (query head n of group k is n = k * G + g)."""
    config = CONFIG.replace(attention_bias=True)
    model = create_model(config, seed=9)
    gradients = nnx.jit(nnx.grad(next_token_loss))(model, jnp.asarray(windows))
    scores = structure_importance(model, windows, "taylor", batch_size=4)
    group_size = config.group_size
    for index in (0, 3):
        block, grads = model.layers[index], gradients["layers"][index]

        def saliency(module: str, name: str, block=block, grads=grads) -> np.ndarray:
            weight = getattr(getattr(block, module), name)[...]
            return np.abs(np.asarray(weight) * np.asarray(grads[module][name][...]))

        for group in range(config.num_kv_heads):
            queries = list(range(group * group_size, (group + 1) * group_size))
            expected = (saliency("attention", "q_proj")[:, queries].sum()
                        + saliency("attention", "k_proj")[:, group].sum()
                        + saliency("attention", "v_proj")[:, group].sum()
                        + saliency("attention", "o_proj")[queries].sum()
                        + saliency("attention", "q_bias")[queries].sum()
                        + saliency("attention", "k_bias")[group].sum()
                        + saliency("attention", "v_bias")[group].sum())
            np.testing.assert_allclose(scores.kv_groups[index, group], expected, rtol=1e-4)
        for channel in (0, 77):
            expected = (saliency("mlp", "gate_proj")[:, channel].sum()
                        + saliency("mlp", "up_proj")[:, channel].sum()
                        + saliency("mlp", "down_proj")[channel].sum())
            np.testing.assert_allclose(scores.channels[index, channel], expected, rtol=1e-4)
        every_weight = sum(np.abs(np.asarray(w) * np.asarray(g)).sum() for w, g in zip(
            jax.tree.leaves(nnx.state(block, nnx.Param)), jax.tree.leaves(grads)))
        np.testing.assert_allclose(scores.layers[index], every_weight, rtol=1e-4)
