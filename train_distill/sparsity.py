"""Fixed sparsity masks for recovering a pruned student: pruned weights stay exactly zero.

`jaxinfer prune` (magnitude, Wanda, SparseGPT; unstructured or N:M) writes a float
checkpoint whose pruned entries are exact zeros, and it prunes only the decoder blocks'
linear weights (q, k, v, o, gate, up, down), never norms, embeddings or the LM head. The
mask is read back from those zeros: `sparsity_masks` marks, for every block linear that
holds at least one exact zero, which entries are alive. Other parameters get no mask.

The train step then applies the mask twice (`apply_masks`):
  * to the gradients, before clipping and the optimizer, so the global norm counts only the
    live weights and Adam's moments of a pruned entry stay zero;
  * to the parameters after `optax.apply_updates`, so no update can revive a pruned entry
    whatever the optimizer does (Muon's orthogonalized update, for one, is dense even for a
    masked gradient, and AdamW's decay term is then zero too).
Because the mask is re-applied to the values (not merely to the updates), the pruned
entries are exactly 0.0 after every step, and an N:M pattern holds throughout.

Masks are keyed by the parameter's key path (`jax.tree_util.keystr`), so the same dict
masks the parameter tree, the gradient tree and the update tree, which share its structure.
Each mask is a boolean array with its parameter's shape and sharding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# The linear weights `jaxinfer.prune` prunes (`jaxinfer.quant.linear.linear_sites` minus
# the LM head, which every default pruning config keeps dense).
PRUNABLE_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                  "down_proj")

Masks = dict[str, jax.Array]  # keystr(path) -> bool array, True where the weight is alive


def _names(path: tuple[Any, ...]) -> list[str]:
    """The dict keys and attribute names along a key path, without indices."""
    names = []
    for entry in path:
        name = getattr(entry, "key", None) or getattr(entry, "name", None)
        if isinstance(name, str):
            names.append(name)
    return names


def is_prunable(path: tuple[Any, ...]) -> bool:
    """Whether the parameter at key `path` is a block linear weight that pruning touches."""
    names = _names(path)
    return "layers" in names and any(name in PRUNABLE_NAMES for name in names[-2:])


def sparsity_masks(params: Any) -> Masks:
    """The live-entry masks of the block linears of `params` that hold exact zeros.

    Args:
        params: A parameter tree (an `nnx.State` of `nnx.Param`, possibly sharded).

    Returns:
        `{keystr(path): mask}`, each mask `params`' leaf `!= 0` (same shape and sharding);
        parameters with no zero, and every non-linear parameter, are left out, so a dense
        student gets `{}` and trains unconstrained.
    """
    masks: Masks = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not is_prunable(path):
            continue
        alive = leaf != 0  # elementwise, so the mask keeps the leaf's sharding
        if not bool(jnp.all(alive)):
            masks[jax.tree_util.keystr(path)] = alive
    return masks


def apply_masks(tree: Any, masks: Masks) -> Any:
    """`tree` with every masked leaf's dead entries set to exactly zero.

    Args:
        tree: Parameters, gradients or updates: the structure the masks were taken from.
        masks: From `sparsity_masks`; leaves without a mask pass through unchanged.
    """
    if not masks:
        return tree

    def mask_leaf(path: tuple[Any, ...], leaf: jax.Array) -> jax.Array:
        mask = masks.get(jax.tree_util.keystr(path))
        if mask is None:
            return leaf
        return jnp.where(mask, leaf, jnp.zeros((), leaf.dtype))

    return jax.tree_util.tree_map_with_path(mask_leaf, tree)


def mask_summary(masks: Masks) -> tuple[int, int]:
    """(pruned entries held at zero, entries of the masked weights in all)."""
    pruned = sum(int(mask.size - jnp.sum(mask)) for mask in masks.values())
    return pruned, sum(int(mask.size) for mask in masks.values())
