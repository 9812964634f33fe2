"""HARP: high-layer attention pruning with rescaling (METHODS.md §7, Liu & Liu 2025).

In the top n blocks of a model, W_q and W_k are dropped: each token attends only to itself,
so its attention output is W_o W_v norm(h) (`jaxinfer.models.harp_attention`), and the block
adds alpha times that to the residual stream. Those blocks keep no KV cache and compute no
QK^T; their MLP sub-block is unchanged. The result is a `ModelConfig` with `harp_alphas`
(the top n alphas, bottom to top) whose checkpoint lacks those blocks' q/k weights.

- `to_harp(model, alphas)`: the conversion itself, no calibration (alpha = 1 is the plain
  "attend only to yourself" replacement).
- `search_alphas(model, windows, num_layers)`: the greedy alpha search. It starts from the
  n blocks converted with alpha = 1 and, from the top block down, sets each block's alpha to
  the value of `grid` with the lowest next-token cross-entropy on the calibration windows
  (the log of their perplexity), the blocks above at their chosen alphas and those below at
  1. The current value (1) is kept unless a grid value is strictly better, so the chosen
  alphas never score worse than all ones on the calibration windows.
- `harp_prune(model, windows, num_layers, alphas=None)`: either of the two, returning the
  HARP model and its alphas (the entry point of `jaxinfer prune --harp` and benchmarks).

A block's alpha only changes the blocks from it upwards, so the search computes once, per
calibration batch, the residual stream entering each of the n blocks (all at alpha = 1
below the block being searched, as they are then) and that block's `W_o W_v norm(h)`, and
scores a candidate alpha by running only the block's MLP and the blocks above it: one
compiled program per block, the alpha a traced scalar. It keeps `[n, B, T, D]` of these
activations per batch of windows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models import Transformer
from jaxinfer.prune.apply import progress_bar
from jaxinfer.prune.importance import logits_next_token_loss
from jaxinfer.quant.calibration import positions_for

# 0, 0.1, ..., 1.0: the grid of the search unless another is given.
DEFAULT_SEARCH_GRID = tuple(round(0.1 * step, 1) for step in range(11))
DEFAULT_BATCH_SIZE = 8
# A grid value replaces the current alpha only when its loss is lower by more than this
# fraction of the current loss, so float noise between equal candidates changes nothing.
_RELATIVE_TOLERANCE = 1e-6


def _check_convertible(model: Transformer, num_layers: int) -> None:
    """Raises ValueError unless `model`'s top `num_layers` blocks can be made HARP blocks."""
    config = model.config
    if model.stacked_layers is not None:
        raise ValueError("HARP converts the model with unstacked layers, not the engine's "
                         "scanning copy")
    if not 1 <= num_layers < config.num_layers:
        raise ValueError(f"HARP of {num_layers} layers: need 1 <= n < num_layers = "
                         f"{config.num_layers} (the bottom block keeps its attention)")
    if num_layers < config.num_harp_layers:
        raise ValueError(f"the model already has {config.num_harp_layers} HARP layers; "
                         f"cannot give it {num_layers}")
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        if not isinstance(value, jax.Array) or not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"{'.'.join(map(str, path))} is not a float array: HARP works "
                             "on float models (quantize after pruning)")


def to_harp(model: Transformer, alphas: Sequence[float]) -> Transformer:
    """A copy of `model` whose top `len(alphas)` blocks are HARP blocks with these alphas.

    Every remaining weight is the model's (v/o of the converted blocks included); their q/k
    projections (and biases) are dropped. A model that already has HARP layers may be given
    new alphas for them and more layers converted.

    Args:
        model: A float model with unstacked layers (left unchanged).
        alphas: One alpha in [0, 1] per converted block, bottom to top (the last is the top
            block's).

    Raises:
        ValueError: Too many or too few layers, an alpha outside [0, 1], a quantized or
            stacked model.
    """
    alphas = tuple(float(alpha) for alpha in alphas)
    _check_convertible(model, len(alphas))
    config = model.config.replace(harp_alphas=alphas)
    graphdef, abstract_state = nnx.split(
        nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    source = dict(nnx.to_flat_state(nnx.state(model)))
    # The HARP model's parameters are a subset of the dense model's, at the same paths.
    state = nnx.from_flat_state(
        [(path, variable.replace(source[path].get_value()))
         for path, variable in nnx.to_flat_state(abstract_state)])
    return nnx.merge(graphdef, state)


def _batches(windows: np.ndarray, batch_size: int) -> list[jax.Array]:
    """`[B, T]` windows as `[batch_size, T]` int32 chunks (the last may be shorter)."""
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size}: must be >= 1")
    windows = np.asarray(windows, np.int32)  # [B, T]
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"calibration windows of shape {windows.shape}: need [B, T >= 2]")
    return [jnp.asarray(windows[start:start + batch_size])
            for start in range(0, windows.shape[0], batch_size)]


@functools.partial(jax.jit, static_argnums=0)
def _model_loss(graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array) -> jax.Array:
    logits, _ = nnx.merge(graphdef, state)(token_ids)  # [B, T, V]
    return logits_next_token_loss(logits, token_ids)


def calibration_loss(model: Transformer, windows: np.ndarray, *,
                     batch_size: int = DEFAULT_BATCH_SIZE) -> float:
    """Mean next-token cross-entropy of `model` over `[B, T]` windows (the log of their
    perplexity), each window's tokens 1..T-1 given those before, through the full forward."""
    graphdef, state = nnx.split(model)
    total, count = 0.0, 0
    for token_ids in _batches(windows, batch_size):
        total += float(_model_loss(graphdef, state, token_ids)) * token_ids.shape[0]
        count += token_ids.shape[0]
    return total / count


@functools.partial(jax.jit, static_argnums=(0, 3))
def _harp_block_inputs(graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array,
                       first: int) -> tuple[jax.Array, jax.Array]:
    """The residual stream entering each HARP block `first..L-1` and that block's
    `W_o W_v norm(h)`, both `[n, B, T, D]`, the model run as it is."""
    model = nnx.merge(graphdef, state)
    positions = positions_for(token_ids)  # [B, T]
    x = model.embed_tokens(token_ids)  # [B, T, D]
    inputs, value_outputs = [], []
    for index, block in enumerate(model.layers):
        if index >= first:
            inputs.append(x)
            value_outputs.append(block.attention.value_output(block.input_norm(x)))
        x, _ = block(x, positions, None)  # [B, T, D]
    return jnp.stack(inputs), jnp.stack(value_outputs)  # [n, B, T, D] each


@functools.partial(jax.jit, static_argnums=(0, 2))
def _candidate_loss(graphdef: nnx.GraphDef, state: nnx.State, layer: int, block_input: jax.Array,
                    value_output: jax.Array, alpha: jax.Array, token_ids: jax.Array
                    ) -> jax.Array:
    """The loss with block `layer`'s alpha set to `alpha` (a traced scalar), from its
    `[B, T, D]` input and value output; the blocks above run as the model has them."""
    model = nnx.merge(graphdef, state)
    positions = positions_for(token_ids)  # [B, T]
    block = model.layers[layer]
    x = block.feed_forward(block_input + alpha.astype(value_output.dtype)
                           * value_output)  # [B, T, D]
    for upper in model.layers[layer + 1:]:
        x, _ = upper(x, positions, None)  # [B, T, D]
    logits = model.logits(model.final_hidden(x))  # [B, T, V]
    return logits_next_token_loss(logits, token_ids)


def search_alphas(model: Transformer, windows: np.ndarray, num_layers: int, *,
                  grid: Sequence[float] = DEFAULT_SEARCH_GRID,
                  batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True
                  ) -> tuple[float, ...]:
    """HARP's greedy alpha search (module docstring): one alpha per top block, bottom to top.

    Args:
        model: A float model with unstacked layers (left unchanged).
        windows: `[B, T]` calibration token windows.
        num_layers: How many top blocks to convert.
        grid: Candidate alphas, each in [0, 1].
        batch_size: Windows per forward pass (only memory depends on it).
        progress: Show a progress bar over the candidate passes on stderr.

    Returns:
        The chosen alphas of the top `num_layers` blocks, bottom to top.

    Raises:
        ValueError: A bad grid, layer count, window shape or model (see `to_harp`).
    """
    grid = tuple(float(alpha) for alpha in grid)
    if not grid or any(not 0.0 <= alpha <= 1.0 for alpha in grid):
        raise ValueError(f"alpha search grid {grid}: need values in [0, 1]")
    alphas = [1.0] * num_layers
    current = to_harp(model, alphas)
    batches = _batches(windows, batch_size)
    first = current.config.num_cache_layers
    graphdef, state = nnx.split(current)
    # Blocks below the one being searched stay at alpha = 1 until their turn, so one pass
    # with every alpha at 1 gives every searched block's input and value output.
    activations = [_harp_block_inputs(graphdef, state, token_ids, first)
                   for token_ids in batches]  # per batch: [n, B, T, D] x 2
    weights = [token_ids.shape[0] / sum(b.shape[0] for b in batches) for token_ids in batches]
    bar = progress_bar(num_layers * len(grid), progress, "HARP alpha search")
    try:
        for offset in reversed(range(num_layers)):  # the top block first
            loss_of = functools.partial(_search_loss, *nnx.split(current), first, offset,
                                        batches=batches, activations=activations,
                                        weights=weights)

            best_alpha, best_loss = alphas[offset], loss_of(alphas[offset])
            for alpha in grid:
                loss = best_loss if alpha == best_alpha else loss_of(alpha)
                if loss < best_loss - _RELATIVE_TOLERANCE * abs(best_loss):
                    best_alpha, best_loss = alpha, loss
                bar.update(1)
            alphas[offset] = best_alpha
            current = to_harp(current, alphas)
    finally:
        bar.close()
    return tuple(alphas)


def _search_loss(graphdef: nnx.GraphDef, state: nnx.State, first: int, offset: int,
                 alpha: float, *, batches: list[jax.Array],
                 activations: list[tuple[jax.Array, jax.Array]], weights: list[float]
                 ) -> float:
    """The calibration loss with HARP block `first + offset` at `alpha`: the mean over the
    batches, each weighted by its share of the windows."""
    return sum(weight * float(_candidate_loss(
        graphdef, state, first + offset, inputs[offset], value_outputs[offset],
        jnp.float32(alpha), token_ids))
        for weight, token_ids, (inputs, value_outputs) in zip(weights, batches, activations))


def harp_prune(model: Transformer, windows: np.ndarray | None, num_layers: int,
               alphas: Sequence[float] | float | None = None, *,
               search_grid: Sequence[float] = DEFAULT_SEARCH_GRID,
               batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True
               ) -> tuple[Transformer, tuple[float, ...]]:
    """HARP-prunes the top `num_layers` blocks of `model`.

    Args:
        model: A float model with unstacked layers (left unchanged).
        windows: `[B, T]` calibration token windows for the alpha search (unused, may be
            None, when `alphas` is given).
        num_layers: How many top blocks lose their q/k projections and KV cache.
        alphas: None to search the alphas on `windows`; one float for every block (1.0:
            no rescaling); or one per block, bottom to top.
        search_grid: The search's candidate alphas.
        batch_size: Calibration windows per forward pass.
        progress: Show the search's progress bar on stderr.

    Returns:
        `(the HARP model, its alphas bottom to top)`.

    Raises:
        ValueError: A search without windows, alphas of the wrong count or outside [0, 1],
            or a model HARP cannot convert (see `to_harp`).
    """
    if alphas is None:
        if windows is None:
            raise ValueError("the HARP alpha search needs calibration windows")
        chosen = search_alphas(model, windows, num_layers, grid=search_grid,
                               batch_size=batch_size, progress=progress)
    elif isinstance(alphas, (int, float)):
        chosen = (float(alphas),) * num_layers
    else:
        chosen = tuple(float(alpha) for alpha in alphas)
        if len(chosen) != num_layers:
            raise ValueError(f"{len(chosen)} HARP alphas for {num_layers} layers")
    if any(not 0.0 <= alpha <= 1.0 for alpha in chosen):
        raise ValueError(f"HARP alphas {chosen}: each must be in [0, 1]")
    return to_harp(model, chosen), chosen


__all__ = ["DEFAULT_SEARCH_GRID", "calibration_loss", "harp_prune", "search_alphas", "to_harp"]
