"""Calibration data for GPTQ and SmoothQuant: token windows, and the inputs of each linear.

The inputs are captured with the model's own linear-input hook
(`jaxinfer.models.layers.simulated_quantization`), which every block calls on the input of
each group of linear layers, in forward order:

    0: attention input       [B, T, D]     -> q_proj, k_proj, v_proj
    1: attention output      [B, T, N, H]  -> o_proj
    2: MLP input             [B, T, D]     -> gate_proj, up_proj
    3: SwiGLU hidden         [B, T, F]     -> down_proj

so no forward code is duplicated here. The hook acts while a function is traced, so each
block run is jitted with the recording hook inside its own trace and the captured inputs
are outputs of that program.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models import Transformer
from jaxinfer.models.layers import MLP, simulated_quantization
from jaxinfer.models.transformer import DecoderBlock

# Which captured input (see the module docstring) feeds each projection of a block.
INPUT_INDEX = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2,
               "up_proj": 2, "down_proj": 3}


def calibration_windows(token_ids: Sequence[int] | np.ndarray, window: int,
                        max_tokens: int) -> np.ndarray:
    """Disjoint `[B, window]` windows from the start of a token stream, at most
    `max_tokens` tokens in all.

    Raises:
        ValueError: The stream holds less than one window.
    """
    ids = np.asarray(token_ids, np.int32)  # [N]
    count = min(ids.size, max_tokens) // window
    if count < 1:
        raise ValueError(f"calibration needs at least one window of {window} tokens; the "
                         f"text gives {ids.size} tokens (max_tokens = {max_tokens})")
    return ids[:count * window].reshape(count, window)  # [B, window]


def positions_for(token_ids: jax.Array) -> jax.Array:
    """`[B, T]` positions 0..T-1 for every row of `[B, T]` windows."""
    return jnp.broadcast_to(jnp.arange(token_ids.shape[1], dtype=jnp.int32), token_ids.shape)


def embedding_output(model: Transformer, token_ids: jax.Array) -> jax.Array:
    """The `[B, T, D]` residual stream entering the first block (after any OSP input
    projection), as the model's own forward computes it."""
    return jax.jit(lambda graphdef, state, ids: nnx.merge(graphdef, state).embed_tokens(ids),
                   static_argnums=0)(*nnx.split(model), token_ids)


def run_block(block: DecoderBlock, x: jax.Array, positions: jax.Array
              ) -> tuple[jax.Array, list[jax.Array]]:
    """Runs one block without a cache; returns its `[B, T, D]` output and its four captured
    linear inputs (see the module docstring), each flattened to `[B * T, K]`.

    Jitted per block structure: blocks at the same stage of quantization share one program.

    Raises:
        ValueError: The block is a mixture of experts (its experts are not captured).
    """
    if not isinstance(block.mlp, MLP):
        raise ValueError("calibration captures dense blocks only; MoE experts stay float")
    graphdef, state = nnx.split(block)
    return _run_block(graphdef, state, x, positions)


@functools.partial(jax.jit, static_argnums=0)
def _run_block(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, positions: jax.Array
               ) -> tuple[jax.Array, list[jax.Array]]:
    # The hook is read while this function is traced, and the captured values are outputs
    # of the same trace, so capturing works under jit.
    captured: list[jax.Array] = []

    def record(inputs: jax.Array) -> jax.Array:
        captured.append(inputs)
        return inputs

    with simulated_quantization(linear_inputs=record):
        out, _ = nnx.merge(graphdef, state)(x, positions, None)  # [B, T, D]
    if len(captured) != len(set(INPUT_INDEX.values())):
        raise ValueError(f"expected 4 linear inputs from a block, captured {len(captured)}")
    flat = [inputs.reshape(-1, int(np.prod(inputs.shape[2:]))) for inputs in captured]
    return out, flat  # [B, T, D], 4 x [B * T, K]


def collect_block_inputs(model: Transformer, windows: np.ndarray) -> list[list[jax.Array]]:
    """Per block, its four captured `[B * T, K]` linear inputs on the calibration windows,
    each block fed by the previous block's output (of `model` as it is)."""
    token_ids = jnp.asarray(windows)  # [B, T]
    positions = positions_for(token_ids)  # [B, T]
    x = embedding_output(model, token_ids)  # [B, T, D]
    per_block = []
    for block in model.layers:
        x, inputs = run_block(block, x, positions)
        per_block.append(inputs)
    return per_block
