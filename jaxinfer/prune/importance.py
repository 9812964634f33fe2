"""Importance of a dense model's structures on calibration text: KV groups, MLP channels and
whole decoder layers, scored for structured pruning (`jaxinfer.prune.structured`).

Two estimators (METHODS.md §7, Minitron: Muralidharan et al. 2024):

- **Activation** (`activation_importance`): one forward pass over the calibration windows,
  block by block, through `jaxinfer.quant.calibration.run_block`, which captures each block's
  linear inputs with the model's own forward:
    - a KV group: the L2 norm over head_dim of each of its query heads' attention outputs
      (the `attention_output` site, o_proj's input), summed over tokens and over the G query
      heads that share the group's key and value;
    - an MLP channel: the mean |activation| of the gated intermediate silu(gate) * up (the
      `mlp_hidden` site, down_proj's input) over tokens;
    - a layer: block influence, 1 - cos(block input, block output) averaged over tokens.
- **Taylor** (`taylor_importance`): the first-order estimate of the loss change from removing
  a structure, |w · ∂L/∂w| summed over every weight the structure owns, with L the next-token
  cross-entropy on the calibration windows. A KV group owns its query heads' q rows and
  o_proj rows and its own k and v (and their biases); a channel owns its gate and up columns
  and its down_proj row; a layer owns every parameter of its block.

Higher is more important under both. Only dense (non-MoE), float, unstacked models are scored.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models import Transformer
from jaxinfer.quant.calibration import embedding_output, positions_for, run_block

IMPORTANCE_KINDS = ("activation", "taylor")


class StructureScores(NamedTuple):
    """Importance of every prunable structure of a model (higher: keep).

    Attributes:
        kv_groups: `[L, K]` per layer, one score per key/value head with its query heads.
        channels: `[L, F]` per layer, one score per MLP intermediate channel.
        layers: `[L]` one score per decoder layer.
    """

    kv_groups: np.ndarray  # [L, K]
    channels: np.ndarray  # [L, F]
    layers: np.ndarray  # [L]


def check_prunable(model: Transformer) -> None:
    """Raises ValueError unless `model` is one structured pruning can score and slice: a
    dense float model without HARP layers, with its layers as a list (not the engine's
    stacked copy)."""
    config = model.config
    if config.is_moe:
        raise ValueError("structured pruning handles dense models only (this one is a "
                         "mixture of experts)")
    if model.stacked_layers is not None:
        raise ValueError("structured pruning needs the model with unstacked layers, not the "
                         "engine's scanning copy")
    if config.harp_alphas:
        raise ValueError("structured pruning of a HARP model (its top layers have no q/k): "
                         "prune structures first, then convert with HARP")
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        if not isinstance(value, jax.Array) or not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"{'.'.join(map(str, path))} is not a float array: structured "
                             "pruning works on float models (prune before quantizing)")


DEFAULT_BATCH_SIZE = 8


def _batches(windows: np.ndarray, batch_size: int) -> list[jax.Array]:
    """`[B, T]` windows as `[batch_size, T]` chunks (the last may be shorter)."""
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size}: must be >= 1")
    windows = np.asarray(windows, np.int32)  # [B, T]
    return [jnp.asarray(windows[start:start + batch_size])
            for start in range(0, windows.shape[0], batch_size)]


def activation_importance(model: Transformer, windows: np.ndarray, *,
                          batch_size: int = DEFAULT_BATCH_SIZE) -> StructureScores:
    """Minitron's activation importance of KV groups, MLP channels and layers.

    Args:
        model: A dense float model (see `check_prunable`).
        windows: `[B, T]` calibration token windows (`calibration_windows`).
        batch_size: Windows per forward pass; the scores are the same for any value (up to
            float rounding), only the memory a pass takes changes.

    Returns:
        The scores of every structure, from one pass over the windows.
    """
    check_prunable(model)
    config = model.config
    layers = config.num_layers
    kv_groups = np.zeros((layers, config.num_kv_heads))  # [L, K] sums over tokens
    channels = np.zeros((layers, config.intermediate_size))  # [L, F] sums over tokens
    influence = np.zeros(layers)  # [L] sums over tokens
    tokens = 0
    for token_ids in _batches(windows, batch_size):
        positions = positions_for(token_ids)  # [batch_size, T]
        x = embedding_output(model, token_ids)  # [batch_size, T, D]
        for index, block in enumerate(model.layers):
            # [batch_size, T, D], site -> [batch_size * T, I]
            out, captured = run_block(block, x, positions)
            group, channel, layer = jax.device_get(_activation_sums(
                x, out, captured["attention_output"], captured["mlp_hidden"],
                config.num_kv_heads, config.head_dim))  # [K], [F], []
            kv_groups[index] += group
            channels[index] += channel
            influence[index] += layer
            x = out
        tokens += token_ids.size
    return StructureScores(kv_groups, channels / tokens, influence / tokens)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _activation_sums(block_input: jax.Array, block_output: jax.Array,
                     attention_output: jax.Array, mlp_hidden: jax.Array, num_kv_heads: int,
                     head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's `[K]` group, `[F]` channel and `[]` layer scores from its captures,
    summed over the tokens (the caller divides the means by the token count)."""
    tokens = attention_output.shape[0]
    # Query head n = k * G + g: the grouping `dot_product_attention` uses.
    heads = attention_output.astype(jnp.float32).reshape(
        tokens, num_kv_heads, -1, head_dim)  # [B * T, K, G, H]
    group = jnp.linalg.norm(heads, axis=-1).sum(axis=(0, 2))  # [K]
    channel = jnp.abs(mlp_hidden.astype(jnp.float32)).sum(axis=0)  # [F]
    inputs = block_input.astype(jnp.float32)  # [B, T, D]
    outputs = block_output.astype(jnp.float32)  # [B, T, D]
    cosine = (inputs * outputs).sum(-1) / jnp.maximum(
        jnp.linalg.norm(inputs, axis=-1) * jnp.linalg.norm(outputs, axis=-1),
        1e-12)  # [B, T]
    return group, channel, (1.0 - cosine).sum()


def taylor_importance(model: Transformer, windows: np.ndarray, *,
                      batch_size: int = DEFAULT_BATCH_SIZE) -> StructureScores:
    """First-order Taylor importance, |w · ∂L/∂w| summed per structure (module docstring).

    Args:
        model: A dense float model (see `check_prunable`).
        windows: `[B, T]` calibration token windows; the loss is the mean next-token
            cross-entropy over all of them.
        batch_size: Windows per forward and backward pass (the gradient of the whole loss
            is accumulated over the passes, so only memory depends on it).

    Returns:
        The scores of every structure.
    """
    check_prunable(model)
    graphdef, params = nnx.split(model, nnx.Param)
    batches = _batches(windows, batch_size)
    total = None
    for token_ids in batches:
        # Each batch's mean loss, weighted by its share of the windows: the sum is the
        # gradient of the mean over all windows.
        weight = token_ids.shape[0] / np.asarray(windows).shape[0]
        gradient = _weighted_gradient(graphdef, params, token_ids, weight)
        total = gradient if total is None else jax.tree.map(jnp.add, total, gradient)
    kv_groups, channels, layers = _taylor_scores(graphdef, params, total)
    return StructureScores(*(np.asarray(jax.device_get(scores))
                             for scores in (kv_groups, channels, layers)))


def next_token_loss(model: Transformer, token_ids: jax.Array) -> jax.Array:
    """Mean cross-entropy of each `[B, T]` window's tokens 1..T-1 given those before."""
    logits, _ = model(token_ids)  # [B, T, V]
    return logits_next_token_loss(logits, token_ids)


def logits_next_token_loss(logits: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Mean cross-entropy of `[B, T, V]` logits predicting each `[B, T]` window's tokens
    1..T-1 (logits at t predict token t + 1)."""
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # [B, T-1, V]
    targets = token_ids[:, 1:, None]  # [B, T-1, 1]
    return -jnp.take_along_axis(log_probs, targets, axis=-1).mean()


@functools.partial(jax.jit, static_argnums=0)
def _weighted_gradient(graphdef: nnx.GraphDef, params: nnx.State, token_ids: jax.Array,
                       weight: float) -> nnx.State:
    return jax.grad(lambda p: weight * next_token_loss(nnx.merge(graphdef, p), token_ids))(
        params)


@jax.jit
def _saliency(params: nnx.State, gradients: nnx.State) -> nnx.State:
    return jax.tree.map(lambda w, g: jnp.abs(w.astype(jnp.float32) * g.astype(jnp.float32)),
                        params, gradients)


def _taylor_scores(graphdef: nnx.GraphDef, params: nnx.State, gradients: nnx.State
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per structure, the sum of |w * dL/dw| over the weights it owns."""
    saliency = nnx.merge(graphdef, _saliency(params, gradients))  # |w * dL/dw| per weight
    config = saliency.config
    num_kv, group = config.num_kv_heads, config.group_size
    kv_groups, channels, layers = [], [], []
    for block in saliency.layers:
        attention, mlp = block.attention, block.mlp

        def per_query_head(values: jax.Array) -> jax.Array:
            return values.reshape(num_kv, group).sum(-1)  # [N] -> [K]

        score = (per_query_head(attention.q_proj[...].sum(axis=(0, 2)))  # [D, N, H] -> [K]
                 + attention.k_proj[...].sum(axis=(0, 2))  # [D, K, H] -> [K]
                 + attention.v_proj[...].sum(axis=(0, 2))
                 + per_query_head(attention.o_proj[...].sum(axis=(1, 2))))  # [N, H, D] -> [K]
        if attention.q_bias is not None:
            score = (score + per_query_head(attention.q_bias[...].sum(-1))  # [N, H] -> [K]
                     + attention.k_bias[...].sum(-1) + attention.v_bias[...].sum(-1))
        kv_groups.append(score)  # [K]
        channels.append(mlp.gate_proj[...].sum(0) + mlp.up_proj[...].sum(0)  # [D, F] -> [F]
                        + mlp.down_proj[...].sum(1))  # [F, D] -> [F]
        layers.append(sum(leaf.sum() for leaf in jax.tree.leaves(nnx.state(block))))
    return jnp.stack(kv_groups), jnp.stack(channels), jnp.stack(layers)  # [L, K], [L, F], [L]


def structure_importance(model: Transformer, windows: np.ndarray,
                         importance: str = "activation", *,
                         batch_size: int = DEFAULT_BATCH_SIZE) -> StructureScores:
    """Scores with the estimator named by `importance` (one of IMPORTANCE_KINDS), passing
    `batch_size` windows through the model at a time.

    Raises:
        ValueError: An unknown estimator.
    """
    if importance == "activation":
        return activation_importance(model, windows, batch_size=batch_size)
    if importance == "taylor":
        return taylor_importance(model, windows, batch_size=batch_size)
    raise ValueError(f"importance = {importance!r}: supported {IMPORTANCE_KINDS}")
