"""Muon and OSP's optimizer split (METHODS.md section 3), as optax transformations.

Muon, per matrix leaf with gradient G and one momentum buffer M (beta = 0.95):

    M = G + beta M;  U = G + beta M              (Nesterov look-ahead)
    O = NS5(U) * sqrt(max(rows, cols)) * 0.2     (update RMS ~0.2, so it shares AdamW's lr)
    theta -= lr * (O + weight_decay * theta)     (decoupled weight decay, 0.01)

NS5 is five quintic Newton-Schulz iterations in bfloat16 that push every singular value of
U / ||U||_F towards 1 (they land in roughly [0.7, 1.2]). Attention projections are
orthogonalized as the 2-D matrices `[D, N * H]` (q, k, v) and `[N * H, D]` (o); the `[E, ., .]`
expert weights of an MoE block as E separate matrices.

OSP gives Muon every block matrix and the two embedding projections, and gives AdamW the
token embedding, the LM head, and every 0/1-D leaf (norm gains) and bias. This implementation
does not use `optax.contrib.muon`, which differs from the described update: its momentum is an
exponential moving average with bias correction (`beta M + (1 - beta) G`), not `G + beta M`;
its default scale is `sqrt(max(1, fan_out / fan_in))`, not `0.2 sqrt(max(rows, cols))`; and
by default it takes every 2-D leaf, the embedding and the LM head included.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Quintic Newton-Schulz coefficients (Keller Jordan's Muon), as METHODS.md gives them.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_UPDATE_RMS = 0.2


def newton_schulz5(matrix: jax.Array, steps: int = 5,
                   dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
    """Approximately orthogonalizes `[..., I, O]` matrices (singular values to ~[0.7, 1.2]).

    Args:
        matrix: `[..., I, O]`; leading axes are independent matrices.
        steps: Newton-Schulz iterations.
        dtype: The dtype the iterations run in (bfloat16 as in the paper; float32 for tests).

    Returns:
        `[..., I, O]` float32.
    """
    a, b, c = NS_COEFFICIENTS
    transposed = matrix.shape[-2] > matrix.shape[-1]
    x = matrix.astype(jnp.float32)  # [..., I, O]
    if transposed:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))  # [..., 1, 1]
    x = (x / (norm + 1e-8)).astype(dtype)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)  # [..., min(I, O), min(I, O)]
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.astype(jnp.float32)
    return jnp.swapaxes(x, -1, -2) if transposed else x


def _names(path: tuple[Any, ...]) -> list[str]:
    """The dict keys along a pytree path (list indices and attribute steps dropped)."""
    return [str(entry.key) for entry in path
            if isinstance(entry, jax.tree_util.DictKey) and not isinstance(entry.key, int)]


def matrix_view(path: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The `[..., I, O]` shape a leaf is orthogonalized as (see the module docstring)."""
    name = _names(path)[-1] if _names(path) else ""
    if len(shape) == 3 and name in ("q_proj", "k_proj", "v_proj"):
        return (shape[0], shape[1] * shape[2])  # [D, N * H]
    if len(shape) == 3 and name == "o_proj":
        return (shape[0] * shape[1], shape[2])  # [N * H, D]
    return shape  # 2-D matrices, and [E, I, O] expert stacks


def osp_label(path: tuple[Any, ...], leaf: jax.Array) -> str:
    """'muon' or 'adamw': which optimizer OSP gives a parameter leaf."""
    names = _names(path)
    if leaf.ndim < 2 or "lm_head" in names or names[:1] == ["embed"]:
        return "adamw"
    if names and names[-1].endswith("_bias"):
        return "adamw"
    return "muon"


class MuonState(NamedTuple):
    """Momentum buffers, one per leaf."""

    momentum: optax.Updates


def scale_by_muon(beta: float = 0.95, ns_steps: int = 5,
                  ns_dtype: jnp.dtype = jnp.bfloat16) -> optax.GradientTransformation:
    """Muon's direction: Nesterov momentum, Newton-Schulz, RMS scaling (no lr, no decay).

    Args:
        beta: Momentum coefficient.
        ns_steps: Newton-Schulz iterations.
        ns_dtype: Dtype of the Newton-Schulz iterations.
    """

    def init(params: optax.Params) -> MuonState:
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(updates: optax.Updates, state: MuonState,
               params: optax.Params | None = None) -> tuple[optax.Updates, MuonState]:
        del params
        momentum = jax.tree.map(lambda g, m: g.astype(jnp.float32) + beta * m,
                                updates, state.momentum)
        lookahead = jax.tree.map(lambda g, m: g.astype(jnp.float32) + beta * m,
                                 updates, momentum)

        def orthogonalize(path: tuple[Any, ...], u: jax.Array, g: jax.Array) -> jax.Array:
            view = matrix_view(path, u.shape)
            rows, cols = view[-2], view[-1]
            o = newton_schulz5(u.reshape(view), ns_steps, ns_dtype)  # [..., I, O]
            scale = math.sqrt(max(rows, cols)) * MUON_UPDATE_RMS
            return (o * scale).reshape(u.shape).astype(g.dtype)

        directions = jax.tree_util.tree_map_with_path(orthogonalize, lookahead, updates)
        return directions, MuonState(momentum)

    return optax.GradientTransformation(init, update)


def muon(learning_rate: optax.ScalarOrSchedule, weight_decay: float = 0.01,
         beta: float = 0.95, ns_steps: int = 5,
         ns_dtype: jnp.dtype = jnp.bfloat16) -> optax.GradientTransformation:
    """Muon with decoupled weight decay: `theta -= lr * (O + weight_decay * theta)`."""
    return optax.chain(scale_by_muon(beta, ns_steps, ns_dtype),
                       optax.add_decayed_weights(weight_decay),
                       optax.scale_by_learning_rate(learning_rate))


def osp_optimizer(learning_rate: optax.ScalarOrSchedule, *, weight_decay: float = 0.1,
                  muon_weight_decay: float = 0.01, b1: float = 0.9, b2: float = 0.95,
                  eps: float = 1e-8) -> optax.GradientTransformation:
    """OSP's split: Muon for the block matrices and EmbProj, AdamW for the rest.

    Args:
        learning_rate: Shared by both halves (Muon's 0.2 RMS scaling makes that work).
        weight_decay: AdamW's decoupled weight decay.
        muon_weight_decay: Muon's decoupled weight decay (0.01 in METHODS.md).
        b1, b2, eps: AdamW's moments (the paper: 0.9, 0.95, 1e-8).
    """
    labels = lambda params: jax.tree_util.tree_map_with_path(osp_label, params)  # noqa: E731
    return optax.multi_transform(
        {"muon": muon(learning_rate, muon_weight_decay),
         "adamw": optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps,
                              weight_decay=weight_decay)},
        labels)
