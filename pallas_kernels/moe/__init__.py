"""Mixture-of-experts routing and expert computation: the public ops.

`moe_ffn` routes tokens (Mixtral top-k) and runs the experts. Implementations:

* "sorted" (the default) sorts assignments by expert and runs grouped matmuls with
  `jax.lax.ragged_dot`; "dense" runs every expert on every token (the test oracle).
* The kernel dispatch names of `pallas_kernels.dispatch` ("auto", "xla", "reference",
  "pallas", "interpret"): "xla" and "reference" are "sorted"; "pallas" and "interpret" are the
  sorted path with its grouped matmuls in the Pallas kernel (`kernel.grouped_matmul`).

`grouped_matmul` is the grouped matmul itself as a public op, with the same dispatch names.
`moe_ffn_local_experts` is one expert-parallel shard's part: the contribution of the experts
it holds to already-routed tokens, to be summed over the expert axis.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import dispatch
from pallas_kernels.moe import kernel as _kernel
from pallas_kernels.moe.reference import (
    grouped_matmul_int8_reference,
    grouped_matmul_reference,
    moe_dense,
    moe_sorted,
    moe_sorted_partial,
    permute,
    route_top_k,
    sort_by_expert,
    unpermute,
)
from pallas_kernels.moe.tuning import default_blocks

__all__ = [
    "grouped_matmul",
    "grouped_matmul_int8_reference",
    "grouped_matmul_reference",
    "moe_dense",
    "moe_ffn",
    "moe_ffn_local_experts",
    "moe_sorted",
    "permute",
    "route_top_k",
    "sort_by_expert",
    "unpermute",
]

_MOE_IMPLEMENTATIONS = ("dense", "sorted", *dispatch.CHOICES)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    scales: jax.Array | None = None,
    implementation: str = "auto",
    block_m: int | None = None,
    block_k: int | None = None,
    block_n: int | None = None,
) -> jax.Array:
    """Grouped matmul: expert e multiplies its `group_sizes[e]` consecutive rows by `rhs[e]`.

    Args:
        lhs: `[rows, I]` rows sorted by expert.
        rhs: `[E, I, O]` float weights, or int8 weights when `scales` is given.
        group_sizes: `[E]` int32 rows per expert (zeros allowed; rows past the sum are zero).
        scales: `[E, O]` per-expert, per-output-channel scales of int8 `rhs`, or None.
        implementation: A `pallas_kernels.dispatch.CHOICES` name.
        block_m: Kernel row tile; None takes `tuning.default_blocks`.
        block_k: Kernel contraction tile; None takes the default.
        block_n: Kernel output-column tile; None takes the default.

    Returns:
        `[rows, O]` in the dtype of `lhs`, accumulated in f32.
    """
    choice = dispatch.resolve(implementation)
    if choice in ("xla", "reference"):
        if scales is None:
            return grouped_matmul_reference(lhs, rhs, group_sizes)  # [rows, O]
        return grouped_matmul_int8_reference(lhs, rhs, scales, group_sizes)  # [rows, O]
    default_m, default_k, default_n = default_blocks(lhs.dtype, scales is not None)
    blocks = {"block_m": default_m if block_m is None else block_m,
              "block_k": default_k if block_k is None else block_k,
              "block_n": default_n if block_n is None else block_n,
              "interpret": dispatch.interpret_mode(choice)}
    if scales is None:
        return _kernel.grouped_matmul(lhs, rhs, group_sizes, **blocks)  # [rows, O]
    return _kernel.grouped_matmul_int8(lhs, rhs, scales, group_sizes, **blocks)  # [rows, O]


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
        x: `[T, D]` tokens.
        router_logits: `[T, E]`.
        gate: `[E, D, F]` expert gate projections.
        up: `[E, D, F]` expert up projections.
        down: `[E, F, D]` expert down projections.
        top_k: Experts per token.
        implementation: "sorted", "dense", or a `pallas_kernels.dispatch.CHOICES` name.

    Returns:
        `[T, D]` in the dtype of `x`.

    Raises:
        ValueError: An unknown implementation.
    """
    if implementation not in _MOE_IMPLEMENTATIONS:
        raise ValueError(f"unknown MoE implementation {implementation!r}; "
                         f"known: {sorted(_MOE_IMPLEMENTATIONS)}")
    weights, experts = route_top_k(router_logits, top_k)  # [T, A], [T, A]
    if implementation == "dense":
        return moe_dense(x, weights, experts, gate, up, down)  # [T, D]
    if implementation == "sorted":
        return moe_sorted(x, weights, experts, gate, up, down)  # [T, D]
    return moe_sorted(x, weights, experts, gate, up, down,
                      **_sorted_matmul(implementation))  # [T, D]


def moe_ffn_local_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    first_expert: jax.Array | int,
    implementation: str = "auto",
) -> jax.Array:
    """The contribution of experts `first_expert .. first_expert + E - 1` to routed tokens.

    Args:
        x: `[T, D]` tokens.
        weights: `[T, A]` routing weights (`route_top_k`).
        experts: `[T, A]` global expert ids.
        gate: `[E, D, F]` the local experts' gate projections.
        up: `[E, D, F]`.
        down: `[E, F, D]`.
        first_expert: Global id of local expert 0.
        implementation: A `pallas_kernels.dispatch.CHOICES` name for the grouped matmuls.

    Returns:
        `[T, D]` float32; the sum over all shards equals `moe_ffn` (before its final cast).
    """
    return moe_sorted_partial(x, weights, experts, gate, up, down, first_expert=first_expert,
                              **_sorted_matmul(implementation))  # [T, D]


def _sorted_matmul(implementation: str) -> dict[str, functools.partial]:
    """The `grouped_matmul` keyword of `moe_sorted(_partial)` for a dispatch name: none (the
    `ragged_dot` default) on the XLA and reference paths, else the Pallas kernel."""
    choice = dispatch.resolve(implementation)
    if choice in ("xla", "reference"):
        return {}
    return {"grouped_matmul": functools.partial(grouped_matmul, implementation=choice)}
