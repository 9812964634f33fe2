"""HARP's attention: a token attends only to itself, so no queries, keys or KV cache.

HARP (high-layer attention pruning with rescaling; METHODS.md §7, Liu & Liu 2025) drops W_q
and W_k from the top blocks of a model. With its own key as the only one it may see, each
token's softmax weight is exactly 1, so the attention output is its own value:
`o_proj(v_proj(norm(h)))`, query head n reading value head n // G under grouped-query
attention (the grouping `jaxinfer.models.attention.dot_product_attention` uses). The block
scales that by a searched alpha in [0, 1] (`jaxinfer.prune.harp`); alpha = 0 drops the
attention sub-block (the block skips the call).

The module keeps the dense attention's parameter names and logical axes for what is left
(`v_proj`, `o_proj`, `v_bias`), so checkpoints, sharding rules, quantization and activation
hooks address them as they address any block's. It has no KV cache: nothing is written, so
the engine's page pool and every contiguous cache hold only the blocks below
(`ModelConfig.num_cache_layers`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.hooks import ActivationHooks, linear_input
from jaxinfer.models.layers import dtype_of, make_linear, make_param
from jaxinfer.sharding import constrain


class HarpAttention(nnx.Module):
    """Self-only attention of a HARP block: `alpha * o_proj(v of the token itself)`.

    Attributes:
        alpha: The block's rescaling factor (a static float: part of the graph definition).
    """

    def __init__(self, config: ModelConfig, alpha: float, *, rngs: nnx.Rngs) -> None:
        param_dtype = dtype_of(config.param_dtype)
        self.dtype = dtype_of(config.dtype)
        self.alpha = float(alpha)
        self.group_size = config.group_size
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.v_proj = make_linear(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"),
                                  param_dtype)
        self.o_proj = make_linear(rngs, (n, h, d), ("q_heads", "head_dim", "embed"),
                                  param_dtype, input_axes=2)
        if config.attention_bias:
            self.v_bias = make_param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype,
                                     jax.nn.initializers.zeros)
        else:
            self.v_bias = None
        self.activation_hooks: ActivationHooks | None = None  # see `jaxinfer.models.hooks`

    def value_output(self, x: jax.Array) -> jax.Array:
        """`W_o W_v x`, the unscaled attention output of `[B, T, D]` normed hidden states:
        `[B, T, D]`. (The alpha search calls this once and tries every alpha on it.)"""
        x = linear_input(self, "attention_input", x)  # [B, T, D]
        values = self.v_proj(x)  # [B, T, K, H]
        if self.v_bias is not None:
            values = values + self.v_bias[...].astype(self.dtype)
        values = constrain(values, ("batch", "length", "act_kv_heads", None))
        # Softmax over the one visible key is 1: each query head's output is its value head.
        heads = jnp.repeat(values, self.group_size, axis=2)  # [B, T, N, H]
        heads = constrain(heads, ("batch", "length", "act_heads", None))
        heads = linear_input(self, "attention_output", heads)  # [B, T, N, H]
        batch, length, num_heads, head_dim = heads.shape
        return self.o_proj(heads.reshape(batch, length, num_heads * head_dim))  # [B, T, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        """`alpha * W_o W_v x` for `[B, T, D]` normed hidden states: `[B, T, D]`."""
        out = self.value_output(x)  # [B, T, D]
        return out * jnp.asarray(self.alpha, out.dtype)  # [B, T, D]
