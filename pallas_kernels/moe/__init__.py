"""Mixture-of-experts routing and expert computation: the public op.

`moe_ffn` routes tokens (Mixtral top-k) and runs the experts. Implementations:
"sorted" (default everywhere for now) sorts assignments by expert and runs grouped matmuls
with `jax.lax.ragged_dot`; "dense" runs every expert on every token (the test oracle).
"""

from __future__ import annotations

import jax

from pallas_kernels.moe.reference import moe_dense, moe_sorted, route_top_k, sort_by_expert

__all__ = ["moe_dense", "moe_ffn", "moe_sorted", "route_top_k", "sort_by_expert"]

_IMPLEMENTATIONS = {"dense": moe_dense, "sorted": moe_sorted}


def moe_ffn(
    x: jax.Array,
    router_logits: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    top_k: int,
    implementation: str = "sorted",
) -> jax.Array:
    """Routes each token to its top-k experts and mixes their SwiGLU outputs.

    Args:
        x: `[M, D]` tokens.
        router_logits: `[M, E]`.
        gate: `[E, D, F]` expert gate projections.
        up: `[E, D, F]` expert up projections.
        down: `[E, F, D]` expert down projections.
        top_k: Experts per token.
        implementation: "sorted" or "dense".

    Returns:
        `[M, D]` in the dtype of `x`.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown MoE implementation {implementation!r}; "
                         f"known: {sorted(_IMPLEMENTATIONS)}")
    weights, experts = route_top_k(router_logits, top_k)  # [M, k], [M, k]
    return _IMPLEMENTATIONS[implementation](x, weights, experts, gate, up, down)
