"""One-shot pruning of a model: `prune_model(model, config, windows)`.

Layers are pruned in forward order, each fed calibration inputs recomputed through the
already-pruned layers before it, exactly as `jaxinfer.quant.gptq.gptq_quantize_model`
feeds GPTQ (METHODS.md section 7: one capture pass per group of linear layers gives the
input statistics, `H = 2/T X^T X` for SparseGPT and `||X_j||_2` for Wanda). Within a block
the projections are pruned in forward order (q, k, v; o; gate, up; down), each group's
inputs recaptured after the groups before it were pruned.

The result of magnitude, Wanda or SparseGPT is the same float model with zeros in its
weights (save it as a plain checkpoint, `checkpoints.save_hf_checkpoint`); SparseGPT with
`config.quantization` puts `QuantizedLinear` layers in the pruned weights' places (save it
with `jaxinfer.quant.save_quantized_model` and `config.quantization_config()`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models import Transformer
from jaxinfer.models.hooks import SITES
from jaxinfer.prune.config import PruningConfig, PruningScheme
from jaxinfer.prune.masks import input_norms, prune_matrix
from jaxinfer.prune.owl import owl_offsets
from jaxinfer.prune.sparsegpt import sparsegpt_prune, sparsegpt_prune_quantize
from jaxinfer.quant.calibration import INPUT_SITE, embedding_output, positions_for, run_block
from jaxinfer.quant.gptq import hessian
from jaxinfer.quant.linear import LinearSite, copy_model, linear_sites
from pallas_kernels.quant_matmul import dequantize_weight

# Called after each weight with (site, its [T, I] calibration inputs, the dense [I, O]
# weight, the pruned [I, O] weight as the model now multiplies by it): lets tests and
# reports measure per-layer errors.
LayerCallback = Callable[[LinearSite, jax.Array, jax.Array, jax.Array], None]


def prune_model(model: Transformer, config: PruningConfig, windows: np.ndarray | None = None,
                *, on_layer: LayerCallback | None = None, implementation: str = "auto",
                progress: bool = True) -> Transformer:
    """A pruned copy of `model`, layer by layer on calibration windows.

    Args:
        model: The float model (left unchanged); dense blocks only.
        config: Rules, method settings, OWL and the joint quantization scheme.
        windows: `[B, T]` calibration token ids; needed by Wanda, SparseGPT and OWL (and
            by `on_layer`); magnitude alone prunes without them.
        on_layer: Called after each weight (see `LayerCallback`).
        implementation: The `pallas_kernels.dispatch` choice of joint-quantized layers.
        progress: Show a progress bar over the per-layer passes on stderr.

    Raises:
        ValueError: A calibrated method without windows, an MoE model, an already
            quantized weight, or a weight whose shape does not fit its target.
    """
    model = copy_model(model)
    sites = [site for site in linear_sites(model) if config.scheme_for(site.path) is not None]
    calibrated = windows is not None
    if not calibrated and (config.owl or on_layer is not None or any(
            config.scheme_for(site.path).method != "magnitude" for site in sites)):
        raise ValueError("Wanda, SparseGPT, OWL and on_layer need calibration windows")
    for site in sites:
        if site.is_quantized:
            raise ValueError(f"{site.path} is quantized; prune the float model")
    offsets = (owl_offsets(model, config, windows) if config.owl
               else np.zeros(len(model.layers)))  # [L]
    token_ids = None if windows is None else jnp.asarray(windows)  # [B, T]
    positions = None if token_ids is None else positions_for(token_ids)  # [B, T]
    x = None if token_ids is None else embedding_output(model, token_ids)  # [B, T, D]
    groups = []  # (block index or None for the head, capture, sites) in forward order
    for index in range(len(model.layers)):
        for capture in SITES:
            group = [site for site in sites if site.path.startswith(f"layers.{index}.")
                     and INPUT_SITE[site.name] == capture]
            if group:
                groups.append((index, capture, group))
    head = [site for site in sites if site.path == "lm_head"]
    bar = progress_bar(len(groups) + len(head), progress)
    for index, block in enumerate(model.layers):
        for _, capture, group in [entry for entry in groups if entry[0] == index]:
            statistics = _Statistics(None)
            if calibrated:
                _, captured = run_block(block, x, positions)  # with the layers pruned so far
                statistics = _Statistics(captured[capture])  # [B * T, I]
            for site in group:
                _prune_site(site, config, statistics, float(offsets[index]), on_layer,
                            implementation)
            bar.update(1)
        if calibrated:
            x, _ = run_block(block, x, positions)  # [B, T, D] from the pruned block
    for site in head:
        statistics = _Statistics(None)
        if calibrated:
            hidden, _ = model.hidden_states(token_ids, positions)  # [B, T, D]
            statistics = _Statistics(hidden.reshape(-1, hidden.shape[-1]))  # [B * T, D]
        _prune_site(site, config, statistics, 0.0, on_layer, implementation)
        bar.update(1)
    bar.close()
    return model


class _Statistics:
    """One group's `[T, I]` calibration inputs (or None) and what the methods take from
    them, each computed once for the group's sites (q, k and v share them)."""

    def __init__(self, inputs: jax.Array | None) -> None:
        self.inputs = inputs  # [T, I] or None

    @functools.cached_property
    def norms(self) -> np.ndarray | None:
        """`[I]` Wanda's input norms, or None without inputs."""
        return None if self.inputs is None else input_norms(self.inputs)

    @functools.cached_property
    def hessian(self) -> np.ndarray:
        """`[I, I]` SparseGPT's `2/T X^T X`."""
        return hessian(self.inputs)


def _prune_site(site: LinearSite, config: PruningConfig, statistics: _Statistics,
                offset: float, on_layer: LayerCallback | None, implementation: str) -> None:
    scheme = config.scheme_for(site.path)
    sparsity = None if scheme.sparsity is None else scheme.sparsity + offset
    matrix = site.float_matrix()  # [I, O]
    try:
        if scheme.method == "sparsegpt":
            pruned = _sparsegpt(site, scheme, config, matrix, statistics.hessian, sparsity,
                                implementation)  # [I, O]
        else:
            pruned = jnp.asarray(prune_matrix(matrix, scheme, statistics.norms, sparsity),
                                 jnp.float32)  # [I, O]
            site.set_float_matrix(pruned)
    except ValueError as error:
        raise ValueError(f"{site.path}: {error}") from None
    if on_layer is not None:
        on_layer(site, statistics.inputs, matrix, pruned)


def _sparsegpt(site: LinearSite, scheme: PruningScheme, config: PruningConfig,
               matrix: jax.Array, h: np.ndarray, sparsity: float | None,
               implementation: str) -> jax.Array:
    """Prunes (and, with `config.quantization`, quantizes) the site in place given its
    `[I, I]` Hessian; returns the `[I, O]` weight it now multiplies by."""
    options = dict(damping=config.damping, block_size=config.block_size, sparsity=sparsity)
    if config.quantization is None:
        pruned = jnp.asarray(sparsegpt_prune(matrix, h, scheme, **options),
                             jnp.float32)  # [I, O]
        site.set_float_matrix(pruned)
        return pruned
    weight = sparsegpt_prune_quantize(matrix, h, scheme, config.quantization, **options)
    site.quantize(weight, implementation)
    return dequantize_weight(weight)  # [I, O]


class _StderrProgress:
    """A one-line `pruning: done/total` counter on stderr (when tqdm is not installed)."""

    def __init__(self, total: int, description: str = "pruning") -> None:
        self.total, self.done, self.description = total, 0, description

    def update(self, count: int) -> None:
        self.done += count
        print(f"\r{self.description}: {self.done}/{self.total} passes", end="",
              file=sys.stderr,
              flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


class _NoProgress:
    def update(self, count: int) -> None:
        del count

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, description: str = "pruning") -> Any:
    """A progress bar over `total` per-layer passes: tqdm's if it is installed. It has
    `update(count)` and `close()`."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _StderrProgress(total, description)
    return tqdm(total=total, desc=description, unit="pass", file=sys.stderr)
