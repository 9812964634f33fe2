"""Reference mixture-of-experts ops (Mixtral semantics), in plain jnp.

Two implementations of the same function:

* `moe_dense`: every expert runs on every token and the outputs are mixed with the routing
  weights (zero for experts a token was not routed to). Obviously correct and E/A times too
  expensive; it is the oracle for the others.
* `moe_sorted`: the token-expert assignments are sorted by expert, each expert's contiguous
  group of rows goes through `jax.lax.ragged_dot`, and the results are un-permuted and mixed.
  This is the XLA path; the Pallas path is the same function with the grouped matmuls
  swapped for `pallas_kernels.moe.kernel.grouped_matmul`.

`grouped_matmul_reference` and `grouped_matmul_int8_reference` are the references for that
kernel; `permute` and `unpermute` are the gather and the weighted scatter around it.

Weights: `gate` and `up` `[E, D, F]`, `down` `[E, F, D]`; an expert computes
`down(silu(x @ gate) * (x @ up))`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def route_top_k(router_logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Mixtral routing: softmax over experts, top-k, weights renormalized to sum to one.

    Args:
        router_logits: `[T, E]` router outputs per token.
        top_k: Experts per token.

    Returns:
        `(weights [T, A] float32, experts [T, A] int32)`, experts in descending weight order.
    """
    probabilities = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, E]
    weights, experts = jax.lax.top_k(probabilities, top_k)  # [T, A], [T, A]
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)  # [T, A]
    return weights, experts.astype(jnp.int32)


def _expert_ffn(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    hidden = jax.nn.silu(x @ gate) * (x @ up)  # [T, F]
    return hidden @ down  # [T, D]


def moe_dense(x: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array,
              up: jax.Array, down: jax.Array) -> jax.Array:
    """All experts on all tokens, mixed by routing weight.

    Args:
        x: `[T, D]` tokens.
        weights: `[T, A]` routing weights.
        experts: `[T, A]` chosen expert ids.
        gate: `[E, D, F]`.
        up: `[E, D, F]`.
        down: `[E, F, D]`.

    Returns:
        `[T, D]` in the dtype of `x`.
    """
    num_experts = gate.shape[0]
    one_hot = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # [T, A, E]
    mixing = jnp.einsum("ta,tae->te", weights.astype(jnp.float32), one_hot)  # [T, E]
    per_expert = jax.vmap(_expert_ffn, in_axes=(None, 0, 0, 0))(x, gate, up, down)  # [E, T, D]
    mixed = jnp.einsum("te,etd->td", mixing, per_expert.astype(jnp.float32))  # [T, D]
    return mixed.astype(x.dtype)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Orders the flattened token-expert assignments by expert.

    Args:
        experts: `[T, A]` expert ids.
        num_experts: E.

    Returns:
        `(order [T*A] int32, group_sizes [E] int32)`: `order[i]` is the flat assignment
        (token * k + slot) in sorted row i; expert e owns `group_sizes[e]` consecutive rows.
    """
    flat = experts.reshape(-1)  # [T*A]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [T*A]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    return order, group_sizes


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul via `jax.lax.ragged_dot`, accumulated in f32.

    Args:
        lhs: `[rows, I]` rows sorted by group.
        rhs: `[E, I, O]` one weight matrix per group.
        group_sizes: `[E]` int32; group e owns `group_sizes[e]` consecutive rows. Rows past
            `sum(group_sizes)` come back as zeros.

    Returns:
        `[rows, O]` in the dtype of `lhs`.
    """
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes,
                             preferred_element_type=jnp.float32)  # [rows, O]
    return out.astype(lhs.dtype)


def grouped_matmul_int8_reference(lhs: jax.Array, rhs: jax.Array, scales: jax.Array,
                                  group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul with int8 weights: dequantize to f32, then `grouped_matmul_reference`.

    Args:
        lhs: `[rows, I]` rows sorted by group.
        rhs: `[E, I, O]` int8 weights.
        scales: `[E, O]` per-expert, per-output-channel scales.
        group_sizes: `[E]` int32 rows per group.

    Returns:
        `[rows, O]` in the dtype of `lhs`.
    """
    weights = rhs.astype(jnp.float32) * scales.astype(jnp.float32)[:, None, :]  # [E, I, O]
    out = jax.lax.ragged_dot(lhs.astype(jnp.float32), weights, group_sizes,
                             preferred_element_type=jnp.float32)  # [rows, O]
    return out.astype(lhs.dtype)


def permute(x: jax.Array, experts: jax.Array,
            num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gathers one row per token-expert assignment, sorted by expert.

    Args:
        x: `[T, D]` tokens.
        experts: `[T, A]` expert ids.
        num_experts: E.

    Returns:
        `(rows [T*A, D], order [T*A] int32, group_sizes [E] int32)`, as `sort_by_expert`
        describes; sorted row i is token `order[i] // k`.
    """
    top_k = experts.shape[1]
    order, group_sizes = sort_by_expert(experts, num_experts)  # [T*A], [E]
    rows = x[order // top_k]  # [T*A, D], assignment i reads token i // k
    return rows, order, group_sizes


def unpermute(out_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Scatters expert outputs back to assignment order and mixes each token's k of them.

    Args:
        out_sorted: `[T*A, D]` expert outputs in sorted (`permute`) order.
        order: `[T*A]` from `permute`.
        weights: `[T, A]` routing weights.

    Returns:
        `[T, D]` float32.
    """
    num_tokens, top_k = weights.shape
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)  # [T*A, D], back to flat order
    out = out.reshape(num_tokens, top_k, -1).astype(jnp.float32)  # [T, A, D]
    return jnp.einsum("ta,tad->td", weights.astype(jnp.float32), out)  # [T, D]


GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)  # [rows, O]


def moe_sorted(x: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array,
               up: jax.Array, down: jax.Array,
               grouped_matmul: GroupedMatmul = _ragged_dot) -> jax.Array:
    """Sorted dispatch with grouped matmuls; same contract as `moe_dense`.

    Args:
        x: `[T, D]` tokens.
        weights: `[T, A]` routing weights.
        experts: `[T, A]` chosen expert ids.
        gate: `[E, D, F]`.
        up: `[E, D, F]`.
        down: `[E, F, D]`.
        grouped_matmul: `(lhs [rows, I], rhs [E, I, O], group_sizes [E]) -> [rows, O]`;
            `jax.lax.ragged_dot` by default, the Pallas kernel on the kernel path.

    Returns:
        `[T, D]` in the dtype of `x`.
    """
    return moe_sorted_partial(x, weights, experts, gate, up, down,
                              grouped_matmul=grouped_matmul).astype(x.dtype)  # [T, D]


def moe_sorted_partial(x: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array,
                       up: jax.Array, down: jax.Array, *,
                       grouped_matmul: GroupedMatmul = _ragged_dot,
                       first_expert: jax.Array | int = 0) -> jax.Array:
    """The part of the MoE output that the experts `first_expert .. first_expert + E - 1` give.

    Expert parallelism runs this on each shard with its `E` local experts: assignments to
    other experts are sorted past every local group, where the grouped matmul leaves zeros,
    so they add nothing; summing the shards' results over the expert axis gives `moe_sorted`.

    Args:
        x: `[T, D]` tokens.
        weights: `[T, A]` routing weights.
        experts: `[T, A]` chosen (global) expert ids.
        gate: `[E, D, F]` the local experts' weights (likewise `up`, and `down` `[E, F, D]`).
        up: `[E, D, F]`.
        down: `[E, F, D]`.
        grouped_matmul: As for `moe_sorted`.
        first_expert: Global id of local expert 0 (a traced value under `shard_map`).

    Returns:
        `[T, D]` float32.
    """
    num_local = gate.shape[0]
    local = experts - first_expert  # [T, A]
    # Non-local assignments get the extra id num_local: sorted last, outside every group.
    local = jnp.where((local >= 0) & (local < num_local), local, num_local)  # [T, A]
    rows, order, group_sizes = permute(x, local, num_local + 1)  # [T*A, D], [T*A], [E + 1]
    group_sizes = group_sizes[:num_local]  # [E]
    hidden = jax.nn.silu(grouped_matmul(rows, gate, group_sizes)) * grouped_matmul(
        rows, up, group_sizes)  # [T*A, F]
    out_sorted = grouped_matmul(hidden, down, group_sizes)  # [T*A, D]
    return unpermute(out_sorted, order, weights)  # [T, D] float32
