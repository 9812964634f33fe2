"""OWL: outlier-weighed layerwise sparsity (Yin et al., ICML 2024), METHODS.md section 7.

Per decoder layer l, `D_l` is the fraction of the layer's Wanda scores (over every linear
weight of the layer that the config prunes) greater than M times their mean (M ~ 5).
Layers with more outliers are pruned less: each layer's sparsity is the target plus an
offset

    offset_l = -lambda * (D_l - mean D) / max_l |D_l - mean D|

so the sparsities lie in [S - lambda, S + lambda] and their mean is exactly S. (OWL's code
maps D linearly onto a range of width 2 lambda and recentres it on S; this scaling keeps the
same order and mean and also keeps every layer within lambda of S.) The offset is applied
to every unstructured rule of the layer, so a config with several sparsities keeps each as
its mean over the layers; lambda is narrowed when a rule's sparsity is within lambda of 0
or 1.

The scores are taken on the dense model, each block fed by the dense blocks before it, as
OWL does; the pruning pass that follows (`jaxinfer.prune.apply`) recomputes its inputs
through the already-pruned layers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.models import Transformer
from jaxinfer.prune.config import PruningConfig
from jaxinfer.prune.masks import input_norms, wanda_scores
from jaxinfer.quant.calibration import INPUT_SITE, embedding_output, positions_for, run_block
from jaxinfer.quant.linear import linear_sites


def outlier_ratios(model: Transformer, config: PruningConfig, windows: np.ndarray,
                   threshold: float | None = None) -> np.ndarray:
    """`[L]` per decoder layer, the fraction of its pruned weights' Wanda scores above
    `threshold` (default `config.owl_threshold`) times the layer's mean score; 0 for a
    layer with nothing to prune."""
    threshold = config.owl_threshold if threshold is None else threshold
    token_ids = jnp.asarray(windows)  # [B, T]
    positions = positions_for(token_ids)  # [B, T]
    x = embedding_output(model, token_ids)  # [B, T, D]
    sites = linear_sites(model)
    ratios = np.zeros(len(model.layers))  # [L]
    for index, block in enumerate(model.layers):
        chosen = [site for site in sites if site.path.startswith(f"layers.{index}.")
                  and config.scheme_for(site.path) is not None]
        x, inputs = run_block(block, x, positions)  # [B, T, D], site -> [B * T, I]
        if not chosen:
            continue
        norms = {capture: input_norms(inputs[capture])
                 for capture in {INPUT_SITE[site.name] for site in chosen}}  # [I] each
        scores = np.concatenate([
            wanda_scores(site.float_matrix(), norms[INPUT_SITE[site.name]]).ravel()
            for site in chosen])  # [sum of I * O]
        ratios[index] = np.mean(scores > threshold * np.mean(scores))
    return ratios


def layer_offsets(ratios: np.ndarray, spread: float) -> np.ndarray:
    """`[L]` sparsity offsets from `[L]` outlier ratios: mean 0, at most `spread` in size,
    the most outlier-rich layer `-spread` (pruned least); all 0 when the ratios are equal."""
    deviations = np.asarray(ratios, np.float64) - np.mean(ratios)  # [L]
    largest = np.max(np.abs(deviations)) if deviations.size else 0.0
    if largest == 0.0:
        return np.zeros_like(deviations)
    offsets = -spread * deviations / largest  # [L]
    return offsets - np.mean(offsets)  # exact mean 0 after rounding


def owl_offsets(model: Transformer, config: PruningConfig, windows: np.ndarray
                ) -> np.ndarray:
    """`[L]` OWL's per-layer offsets to add to every unstructured sparsity of a layer.

    Lambda is `config.owl_lambda`, narrowed so that every rule's sparsity plus any offset
    stays in [0, 1).
    """
    sparsities = [rule.scheme.sparsity for rule in config.rules
                  if rule.scheme is not None and rule.scheme.sparsity is not None]
    spread = min([config.owl_lambda, *sparsities,
                  *(0.999 * (1.0 - sparsity) for sparsity in sparsities)])
    return layer_offsets(outlier_ratios(model, config, windows), spread)
