"""Sparsity masks: taken from the exact zeros of the block linears only, they zero exactly the
pruned entries of any tree shaped like the parameters, and a dense model gets none."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.prune import PruningConfig, prune_model
from jaxinfer.quant import linear_sites
from train_distill.sparsity import PRUNABLE_NAMES, apply_masks, mask_summary, sparsity_masks


def _params(model) -> nnx.State:
    return nnx.split(model, nnx.Param)[1]


def test_masks_cover_the_pruned_block_linears_and_nothing_else():
    dense = create_model(get_preset("tiny"), seed=0)
    assert sparsity_masks(_params(dense)) == {}
    pruned = prune_model(dense, PruningConfig.for_method("magnitude", pattern=(2, 4)),
                         progress=False)
    # An embedding row or norm gain that happens to hold a zero is never masked.
    pruned.final_norm.weight[...] = pruned.final_norm.weight[...].at[0].set(0.0)
    masks = sparsity_masks(_params(pruned))
    block_linears = [site for site in linear_sites(pruned) if site.path != "lm_head"]
    assert len(masks) == len(block_linears)
    assert all(any(f"['{name}']" in key for name in PRUNABLE_NAMES) for key in masks)
    assert all(mask.dtype == jnp.bool_ for mask in masks.values())
    pruned_count, total = mask_summary(masks)
    assert pruned_count * 2 == total  # 2:4 zeroes exactly half


def test_apply_masks_zeroes_exactly_the_pruned_entries():
    pruned = prune_model(create_model(get_preset("tiny"), seed=0),
                         PruningConfig.for_method("magnitude", sparsity=0.5), progress=False)
    params = _params(pruned)
    masks = sparsity_masks(params)
    ones = jax.tree.map(jnp.ones_like, params)  # a dense "update" everywhere
    masked = apply_masks(ones, masks)
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_masked = dict((jax.tree_util.keystr(path), leaf) for path, leaf in
                       jax.tree_util.tree_flatten_with_path(masked)[0])
    for path, leaf in flat_params:
        key = jax.tree_util.keystr(path)
        expected = (np.asarray(leaf) != 0) if key in masks else np.ones(leaf.shape, bool)
        np.testing.assert_array_equal(np.asarray(flat_masked[key]), expected.astype(
            np.asarray(flat_masked[key]).dtype), err_msg=key)
    assert apply_masks(ones, {}) is ones
