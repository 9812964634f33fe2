"""Calibration data for GPTQ and SmoothQuant: token windows, and the inputs of each linear.

The inputs are captured by the model's own forward: a block copy with capturing
activation hooks (`jaxinfer.models.hooks`) sows the input of each group of linear layers,
named by its site, in forward order:

    "attention_input"   [B, T, D]     -> q_proj, k_proj, v_proj
    "attention_output"  [B, T, N, H]  -> o_proj
    "mlp_input"         [B, T, D]     -> gate_proj, up_proj
    "mlp_hidden"        [B, T, F]     -> down_proj

so no forward code is duplicated here. Each block run is jitted; the sown inputs are popped
inside the same trace and returned as outputs of that program.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models import Transformer
from jaxinfer.models.hooks import CAPTURE, SITES, capture_linear_inputs, with_activation_hooks
from jaxinfer.models.layers import MLP
from jaxinfer.models.transformer import DecoderBlock

# Which captured input (see the module docstring) feeds each projection of a block.
INPUT_SITE = {"q_proj": "attention_input", "k_proj": "attention_input",
              "v_proj": "attention_input", "o_proj": "attention_output",
              "gate_proj": "mlp_input", "up_proj": "mlp_input", "down_proj": "mlp_hidden"}


def calibration_windows(token_ids: Sequence[int] | np.ndarray, window: int,
                        max_tokens: int) -> np.ndarray:
    """Disjoint `[B, window]` windows from the start of a token stream, at most
    `max_tokens` tokens in all.

    Raises:
        ValueError: The stream holds less than one window.
    """
    ids = np.asarray(token_ids, np.int32)  # [len(token_ids)]
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
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Runs one block without a cache; returns its `[B, T, D]` output and its four captured
    linear inputs by site (see the module docstring), each flattened to `[B * T, I]`.

    Jitted per block structure: blocks at the same stage of quantization share one program.

    Raises:
        ValueError: The block is a mixture of experts (its experts are not captured).
    """
    if not isinstance(block.mlp, MLP):
        raise ValueError("calibration captures dense blocks only; MoE experts stay float")
    graphdef, state = nnx.split(with_activation_hooks(block, CAPTURE))
    return _run_block(graphdef, state, x, positions)


@functools.partial(jax.jit, static_argnums=0)
def _run_block(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, positions: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    (out, _), captured = capture_linear_inputs(nnx.merge(graphdef, state), x, positions,
                                               None)  # [B, T, D], site -> [B, T, ...]
    if set(captured) != set(SITES):
        raise ValueError(f"expected the linear inputs {SITES} from a block, captured "
                         f"{sorted(captured)}")
    flat = {site: inputs.reshape(-1, int(np.prod(inputs.shape[2:])))
            for site, inputs in captured.items()}
    return out, flat  # [B, T, D], 4 x [B * T, I]


def collect_block_inputs(model: Transformer, windows: np.ndarray
                         ) -> list[dict[str, jax.Array]]:
    """Per block, its four captured `[B * T, I]` linear inputs by site on the calibration
    windows, each block fed by the previous block's output (of `model` as it is)."""
    token_ids = jnp.asarray(windows)  # [B, T]
    positions = positions_for(token_ids)  # [B, T]
    x = embedding_output(model, token_ids)  # [B, T, D]
    per_block = []
    for block in model.layers:
        x, inputs = run_block(block, x, positions)
        per_block.append(inputs)
    return per_block
