"""Mixtral-style sparse mixture-of-experts feed-forward block.

The block owns the router and the stacked expert weights; routing and the grouped expert
matmuls are `pallas_kernels.moe.moe_ffn`, so the fast kernels slot in without touching the
model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.models.hooks import ActivationHooks, linear_input
from jaxinfer.models.layers import dtype_of, make_linear, make_param
from jaxinfer.sharding import active_axis
from pallas_kernels.moe import moe_ffn, moe_ffn_local_experts, route_top_k


class MoEBlock(nnx.Module):
    """Softmax router, top-k experts with renormalized weights, SwiGLU experts."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs,
                 implementation: str = "auto") -> None:
        param_dtype = dtype_of(config.param_dtype)
        self.dtype = dtype_of(config.dtype)
        self.top_k = config.num_experts_per_token
        self.implementation = implementation
        e, d, f = config.num_experts, config.hidden_size, config.intermediate_size
        self.router = make_linear(rngs, (d, e), ("embed", None), param_dtype)
        self.gate_proj = make_param(rngs, (e, d, f), ("expert", "embed", "mlp"), param_dtype)
        self.up_proj = make_param(rngs, (e, d, f), ("expert", "embed", "mlp"), param_dtype)
        self.down_proj = make_param(rngs, (e, f, d), ("expert", "mlp", "embed"), param_dtype)
        self.activation_hooks: ActivationHooks | None = None  # see `jaxinfer.models.hooks`

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        tokens = linear_input(self, "mlp_input", x).reshape(batch * length, width)  # [T, D]
        router_logits = self.router(tokens, out_dtype=jnp.float32)  # [T, E]
        gate, up, down = (weight[...].astype(self.dtype)  # [E, D, F], [E, D, F], [E, F, D]
                          for weight in (self.gate_proj, self.up_proj, self.down_proj))
        expert_axis, mlp_axis = active_axis("expert"), active_axis("mlp")
        if expert_axis is None and mlp_axis is None:
            out = moe_ffn(tokens, router_logits, gate, up, down, self.top_k,
                          implementation=self.implementation)  # [T, D]
        else:
            out = self._sharded(tokens, router_logits, gate, up, down, expert_axis, mlp_axis)
        return out.reshape(batch, length, width)  # [B, T, D]

    def _sharded(self, tokens: jax.Array, router_logits: jax.Array, gate: jax.Array,
                 up: jax.Array, down: jax.Array, expert_axis: str | None,
                 mlp_axis: str | None) -> jax.Array:
        """Expert (and tensor) parallel MoE: each shard runs its own experts on the tokens
        routed to them.

        Every shard sees all tokens (a decode step's batch is small, so replicating it costs
        less than an all-to-all) and routes them the same way; it computes the outputs of
        its `E / expert_shards` experts, each split along the MLP width over `mlp_axis`,
        and one sum over both axes adds the partial outputs. Assignments to other shards'
        experts cost nothing: they are sorted past the local groups.
        """
        weights, experts = route_top_k(router_logits, self.top_k)  # [T, A], [T, A]
        implementation = "auto" if self.implementation in ("dense", "sorted") else (
            self.implementation)
        summed = tuple(axis for axis in (expert_axis, mlp_axis) if axis is not None)

        def local(tokens: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array,
                  up: jax.Array, down: jax.Array) -> jax.Array:
            first = 0 if expert_axis is None else (
                jax.lax.axis_index(expert_axis) * gate.shape[0])
            partial = moe_ffn_local_experts(tokens, weights, experts, gate, up, down, first,
                                            implementation)  # [T, D] float32
            return jax.lax.psum(partial, summed)

        expert_spec = PartitionSpec(expert_axis, None, mlp_axis)  # [E, D, F]
        down_spec = PartitionSpec(expert_axis, mlp_axis, None)  # [E, F, D]
        out = jax.shard_map(
            local, in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(), expert_spec,
                             expert_spec, down_spec),
            out_specs=PartitionSpec(), check_vma=False,
        )(tokens, weights, experts, gate, up, down)  # [T, D] float32
        return out.astype(tokens.dtype)
