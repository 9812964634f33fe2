"""Mixtral-style sparse mixture-of-experts feed-forward block.

The block owns the router and the stacked expert weights; routing and the grouped expert
matmuls are `pallas_kernels.moe.moe_ffn`, so the fast kernels slot in without touching the
model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import dtype_of, linear_input, make_param
from pallas_kernels.moe import moe_ffn


class MoEBlock(nnx.Module):
    """Softmax router, top-k experts with renormalized weights, SwiGLU experts."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs,
                 implementation: str = "auto") -> None:
        param_dtype = dtype_of(config.param_dtype)
        self.dtype = dtype_of(config.dtype)
        self.top_k = config.num_experts_per_token
        self.implementation = implementation
        e, d, f = config.num_experts, config.hidden_size, config.intermediate_size
        self.router = make_param(rngs, (d, e), ("embed", None), param_dtype)
        self.gate_proj = make_param(rngs, (e, d, f), ("expert", "embed", "mlp"), param_dtype)
        self.up_proj = make_param(rngs, (e, d, f), ("expert", "embed", "mlp"), param_dtype)
        self.down_proj = make_param(rngs, (e, f, d), ("expert", "mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        tokens = linear_input(x).reshape(batch * length, width)  # [M, D]
        router_logits = jnp.einsum("md,de->me", tokens, self.router[...].astype(self.dtype),
                                   preferred_element_type=jnp.float32)  # [M, E]
        out = moe_ffn(tokens, router_logits, self.gate_proj[...].astype(self.dtype),
                      self.up_proj[...].astype(self.dtype),
                      self.down_proj[...].astype(self.dtype), self.top_k,
                      implementation=self.implementation)  # [M, D]
        return out.reshape(batch, length, width)  # [B, T, D]
