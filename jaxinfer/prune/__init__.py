"""Pruning: structured (smaller dense models, `jaxinfer.prune.structured`) and unstructured
(masked weights): one-shot unstructured and N:M masks (magnitude, Wanda, SparseGPT, with
OWL's layer sparsities), applied to a model by regex rules; SparseGPT can quantize the
survivors in the same pass."""

from jaxinfer.prune.apply import prune_model
from jaxinfer.prune.config import (
    KEEP_DENSE_PATTERNS,
    METHODS,
    PruningConfig,
    PruningRule,
    PruningScheme,
    parse_pattern,
)
from jaxinfer.prune.masks import input_norms, keep_mask, magnitude_scores, wanda_scores
from jaxinfer.prune.owl import layer_offsets, outlier_ratios, owl_offsets
from jaxinfer.prune.sparsegpt import sparsegpt_prune, sparsegpt_prune_quantize

__all__ = ["KEEP_DENSE_PATTERNS", "METHODS", "PruningConfig", "PruningRule", "PruningScheme",
           "input_norms", "keep_mask", "layer_offsets", "magnitude_scores", "outlier_ratios",
           "owl_offsets", "parse_pattern", "prune_model", "sparsegpt_prune",
           "sparsegpt_prune_quantize", "wanda_scores"]
