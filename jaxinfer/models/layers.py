"""Small building blocks shared by every model: parameters, RMSNorm, embedding, SwiGLU MLP.

Parameters are created with `make_param`, which records their logical axis names (see
`jaxinfer.sharding`) in the variable's `out_sharding` metadata but does not place them: the
model factory (`jaxinfer.models.create_model`) computes and checks the shardings for a mesh
and initializes every parameter directly on its shards, and the checkpoint loader places each
tensor as it reads it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.hooks import ActivationHooks, linear_input
from jaxinfer.sharding import constrain
from pallas_kernels.dense_matmul import dense_matmul

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]

# Matches transformers' `initializer_range` default, so random models look alike in both.
DEFAULT_INIT_STDDEV = 0.02


def make_param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    logical_axes: Sequence[str | None],
    dtype: jnp.dtype,
    init: Initializer | None = None,
) -> nnx.Param:
    """Creates a parameter tagged with its logical axes.

    Args:
        rngs: Random streams; the `params` stream is used.
        shape: Parameter shape.
        logical_axes: One logical axis name per dimension.
        dtype: Storage dtype.
        init: Initializer; defaults to a normal with stddev DEFAULT_INIT_STDDEV.
    """
    return _make_variable(nnx.Param, rngs, shape, logical_axes, dtype, init)


def _make_variable(variable_type: type[nnx.Param], rngs: nnx.Rngs, shape: Sequence[int],
                   logical_axes: Sequence[str | None], dtype: jnp.dtype,
                   init: Initializer | None, **metadata: Any) -> nnx.Param:
    if len(shape) != len(logical_axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(logical_axes)} differ")
    init = init or jax.nn.initializers.normal(DEFAULT_INIT_STDDEV)
    value = init(rngs.params(), tuple(shape), dtype)  # [*shape]
    # eager_sharding=False: placement is decided once for the whole model, with divisibility
    # checks, by the factory or the loader, not by each variable as it is born.
    return variable_type(value, out_sharding=tuple(logical_axes), eager_sharding=False,
                         **metadata)


class ReadInPlace:
    """Marks a variable type whose layer stack a scan over layers hands over whole, as a
    `StackedLayer` view, because its user multiplies the layer in place (`LinearParam`, and
    the arrays of quantized layers in `jaxinfer.quant`); other variables are sliced."""


class LinearParam(ReadInPlace, nnx.Param):
    """A float linear weight `[*inputs, *outputs]` that multiplies activations by itself.

    `weight(x)` maps `[..., I]` activations (I the product of the input axes) to
    `[..., *outputs]`, in the activations' dtype, the same call as the quantized layers of
    `jaxinfer.quant` (`QuantizedLinear`), so the forward calls whatever weight sits at a
    projection and never asks which kind it is. It is still an `nnx.Param` at the same
    place in the state: checkpoints, sharding rules and optimizers see the same path, shape
    and logical axes as before.

    Metadata `input_axes` (default 1) says how many leading axes are input features: 2 for
    o_proj's `[N, H, D]`, which multiplies `[..., N * H]` activations as one `[N * H, D]`
    matmul (contracting (n, h) as two axes made XLA on CPU copy a transposed o_proj every
    step).
    """

    def __call__(self, x: jax.Array, *, out_dtype: jnp.dtype | None = None) -> jax.Array:
        """`[..., I]` activations times the weight: `[..., *outputs]`.

        Args:
            x: `[..., I]` activations; the weight is cast to their dtype.
            out_dtype: Accumulate and return in this dtype (e.g. float32 logits); default
                the activations' dtype.
        """
        value = self.get_value()
        layer = None
        if isinstance(value, StackedLayer):  # inside a scan over layers
            value, layer = value.stack, value.layer  # [L, *inputs, *outputs], []
        lead = () if layer is None else value.shape[:1]
        shape = value.shape[len(lead):]  # [*inputs, *outputs]
        outputs = shape[self.get_metadata("input_axes", 1):]
        # One [I, O] matrix (a free reshape): the C++ kernel on XLA:CPU for decode-sized
        # products, else XLA's dot. A weight stored in another dtype than x's is cast by
        # dense_matmul after it slices the layer (a cast of the stack would convert every
        # layer), or read as stored (bfloat16 under float32 x) by the CPU kernel.
        matrix = value.reshape(*lead, -1, math.prod(outputs))  # [(L,) I, O]
        out = dense_matmul(x, matrix, layer=layer, out_dtype=out_dtype)  # [..., O]
        return out.reshape(*x.shape[:-1], *outputs)  # [..., *outputs]


@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """What a `LinearParam` holds inside a scan over stacked layers: the whole stack and the
    iteration's layer, so the matmul reads that layer's weight in place.

    Slicing the stack per iteration (what `lax.scan` does to its inputs) made XLA:CPU copy
    every weight of the layer before each dot, a copy per weight, layer and step
    (`jaxinfer.models.scan`).

    Attributes:
        stack: `[L, *inputs, *outputs]` every layer's weight.
        layer: `[]` int32, the layer this iteration runs.
    """

    stack: jax.Array
    layer: jax.Array

    def matrix(self) -> jax.Array:
        """`[*inputs, *outputs]` this layer's weight (a slice: a copy on XLA:CPU)."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, keepdims=False)


def make_linear(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    logical_axes: Sequence[str | None],
    dtype: jnp.dtype,
    *,
    input_axes: int = 1,
    init: Initializer | None = None,
) -> LinearParam:
    """Creates a float linear weight (`LinearParam`) tagged with its logical axes.

    Args:
        rngs: Random streams; the `params` stream is used.
        shape: `[*inputs, *outputs]`.
        logical_axes: One logical axis name per dimension.
        dtype: Storage dtype.
        input_axes: How many leading axes of `shape` are input features.
        init: Initializer; defaults to a normal with stddev DEFAULT_INIT_STDDEV.
    """
    return _make_variable(LinearParam, rngs, shape, logical_axes, dtype, init,
                          input_axes=input_axes)


def dtype_of(name: str) -> jnp.dtype:
    """Maps a config dtype name ("float32", "bfloat16", ...) to a jnp dtype."""
    return jnp.dtype(name)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm, computed in float32 as transformers does.

    With `single_scale`, the gain is one learnable scalar (shape `[1]`, broadcast over the
    channels) instead of a per-channel vector: OSP's Single-Scale RMSNorm, which gives the
    model no per-channel knob with which to grow outlier features.
    """

    def __init__(self, size: int, eps: float, *, param_dtype: jnp.dtype, dtype: jnp.dtype,
                 rngs: nnx.Rngs, single_scale: bool = False) -> None:
        self.eps = eps
        self.dtype = dtype
        self.weight = make_param(rngs, (1 if single_scale else size,), ("norm",), param_dtype,
                                 init=jax.nn.initializers.ones)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)  # [..., D]
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # [..., 1]
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(self.dtype)  # [..., D]
        return normed * self.weight[...].astype(self.dtype)  # gain [D] or [1]


def make_norm(config: ModelConfig, *, rngs: nnx.Rngs) -> RMSNorm:
    """The RMSNorm a `config` model uses (per-channel, or single-scale for OSP)."""
    return RMSNorm(config.hidden_size, config.rms_norm_eps,
                   param_dtype=dtype_of(config.param_dtype), dtype=dtype_of(config.dtype),
                   rngs=rngs, single_scale=config.norm_type == "single_scale")


class Embedding(nnx.Module):
    """Token embedding table; also the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, *, param_dtype: jnp.dtype,
                 dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.dtype = dtype
        self.weight = make_param(rngs, (vocab_size, hidden_size), ("vocab", "embed"),
                                 param_dtype)

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        embedded = jnp.take(self.weight[...], token_ids, axis=0)  # [B, T, D]
        return embedded.astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: logits in float32 from hidden states `x` [B, T, D]."""
        # Cast by dense_matmul where it must (a bfloat16 table under float32 compute is read
        # as stored by the CPU kernel: widening it first wrote a float32 copy every step).
        weight = self.weight[...]  # [V, D]
        return dense_matmul(x.astype(self.dtype), weight, transposed=True,
                            out_dtype=jnp.float32)  # [B, T, V]


def project_together(x: jax.Array, layers: Sequence[Callable[[jax.Array], jax.Array]]
                     ) -> list[jax.Array]:
    """`[layer(x) for layer in layers]` for layers that read the same input (a block's q, k
    and v projections; its gate and up).

    Where the first layer offers `call_together` (`jaxinfer.quant.linear.QuantizedLinear`)
    and it takes them all, one kernel call computes every product: on the CPU, x is
    quantized once and the threads are started once for all the weights (vLLM fuses the same
    projections into one weight; here the parameters stay as they are). Otherwise, one call
    each.
    """
    together = getattr(layers[0], "call_together", None)
    outs = None if together is None else together(x, layers)
    return [layer(x) for layer in layers] if outs is None else outs


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        param_dtype = dtype_of(config.param_dtype)
        self.dtype = dtype_of(config.dtype)
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = make_linear(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.up_proj = make_linear(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.down_proj = make_linear(rngs, (f, d), ("mlp", "embed"), param_dtype)
        self.activation_hooks: ActivationHooks | None = None  # see `jaxinfer.models.hooks`

    def __call__(self, x: jax.Array) -> jax.Array:
        x = linear_input(self, "mlp_input", x)  # [B, T, D]
        gate, up = project_together(x, [self.gate_proj, self.up_proj])  # [B, T, F] each
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))  # [B, T, F]
        hidden = linear_input(self, "mlp_hidden", hidden)  # [B, T, F]
        return self.down_proj(hidden)  # [B, T, D]
