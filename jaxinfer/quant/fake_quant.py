"""Simulated ("fake") quantization: round-to-nearest quantize-dequantize in float.

Used to measure how much a model loses at a bit width before any integer kernel exists
(METHODS.md section 3, the W4A4KV4 protocol):

- weights: symmetric, per output channel, optionally with an MSE search over clipping ratios;
- activations: asymmetric (scale + zero point) per token, at the input of every linear layer
  inside the blocks;
- keys and values: asymmetric in groups of 128 channels (of the flattened `K * H` per token).

The token embedding, the LM head, the MoE router and the norms stay in full precision, as in
the quantization literature's W4A4 protocols.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.models import Transformer
from jaxinfer.models.hooks import ActivationHooks, with_activation_hooks

# Clipping ratios tried by the MSE search (1.0 = no clipping).
CLIP_RATIOS = tuple(1.0 - 0.05 * step for step in range(11))  # 1.0, 0.95, ..., 0.5


def quantize_symmetric(weight: jax.Array, bits: int, reduce_axes: Sequence[int],
                       clip_search: bool = False) -> jax.Array:
    """Symmetric RTN quantize-dequantize with one scale per slice over `reduce_axes`.

    Args:
        weight: Any shape, float.
        bits: Bit width; levels are the integers in [-(2^(b-1) - 1), 2^(b-1) - 1].
        reduce_axes: The axes one scale covers (a weight's input axes: per output channel).
        clip_search: Try every ratio in CLIP_RATIOS of the max and keep, per channel, the one
            with the least squared error.

    Returns:
        The dequantized weight, float32, same shape.
    """
    levels = 2 ** (bits - 1) - 1
    weight = weight.astype(jnp.float32)  # any shape
    peak = jnp.max(jnp.abs(weight), axis=tuple(reduce_axes), keepdims=True)  # [.., 1, ..]

    def at_ratio(ratio: float) -> tuple[jax.Array, jax.Array]:
        scale = jnp.maximum(peak * ratio, 1e-12) / levels  # [.., 1, ..]
        dequantized = jnp.clip(jnp.round(weight / scale), -levels, levels) * scale  # like weight
        error = jnp.sum(jnp.square(dequantized - weight), axis=tuple(reduce_axes),
                        keepdims=True)  # [.., 1, ..]
        return dequantized, error

    best, best_error = at_ratio(1.0)
    for ratio in CLIP_RATIOS[1:] if clip_search else ():
        candidate, error = at_ratio(ratio)
        better = error < best_error
        best = jnp.where(better, candidate, best)
        best_error = jnp.where(better, error, best_error)
    return best


def quantize_asymmetric(x: jax.Array, bits: int, group_size: int | None = None) -> jax.Array:
    """Asymmetric RTN quantize-dequantize per token (or per group of a token's channels).

    Args:
        x: `[B, T, ...]`; everything after the first two axes is one token's vector.
        bits: Bit width; levels 0 .. 2^b - 1 with a per-group zero point.
        group_size: Channels per scale; None means the whole token vector. It is capped at
            the vector's size and must divide it.

    Returns:
        The dequantized `x`, in `x`'s dtype.
    """
    batch, length = x.shape[:2]
    flat = x.reshape(batch, length, -1).astype(jnp.float32)  # [B, T, size]
    size = flat.shape[-1]
    group = size if group_size is None else min(group_size, size)
    if size % group:
        raise ValueError(f"group_size {group} does not divide the {size} channels")
    grouped = flat.reshape(batch, length, size // group, group)  # [B, T, size // group, group]
    low = jnp.min(grouped, axis=-1, keepdims=True)  # [B, T, size // group, 1]
    high = jnp.max(grouped, axis=-1, keepdims=True)  # [B, T, size // group, 1]
    maximum = 2 ** bits - 1
    scale = jnp.maximum(high - low, 1e-12) / maximum  # [B, T, size // group, 1]
    zero = jnp.round(-low / scale)  # [B, T, size // group, 1]
    quantized = jnp.clip(jnp.round(grouped / scale) + zero, 0, maximum)  # like grouped
    return ((quantized - zero) * scale).reshape(x.shape).astype(x.dtype)  # [B, T, ...]


def _input_axes(names: list[str], shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """A block weight's input axes (one scale per output channel), or None to skip it."""
    name = names[-1] if names else ""
    if "layers" not in names or name in ("router",) or len(shape) < 2 or "bias" in name:
        return None  # embedding, LM head, router, norms, biases stay in full precision
    if name == "o_proj":
        return (0, 1)  # [N, H, D]
    if len(shape) == 3 and name in ("gate_proj", "up_proj", "down_proj"):
        return (1,)  # [E, D|F, F|D] experts
    return (0,)  # [D, N|K, H] q/k/v, [D, F] gate/up, [F, D] down


def quantize_model_weights(model: Transformer, bits: int,
                           clip_search: bool = True) -> Transformer:
    """A copy of `model` whose block weights are RTN quantize-dequantized to `bits`."""
    graphdef, state = nnx.split(model)

    def quantize(path: tuple[Any, ...], leaf: Any) -> Any:
        names = [str(getattr(entry, "key", "")) for entry in path]
        names = [name for name in names if name and not name.isdigit()]
        axes = _input_axes(names, getattr(leaf, "shape", ()))
        if axes is None:
            return leaf
        return quantize_symmetric(leaf, bits, axes, clip_search).astype(leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(quantize, state))


@dataclasses.dataclass(frozen=True)
class QuantizationProtocol:
    """Bit widths of a simulated quantization (None: that part stays in full precision)."""

    name: str
    weight_bits: int | None = None
    activation_bits: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 128
    clip_search: bool = True


PROTOCOLS = {
    "W8A8": QuantizationProtocol("W8A8", weight_bits=8, activation_bits=8),
    "W4A4KV4": QuantizationProtocol("W4A4KV4", weight_bits=4, activation_bits=4, kv_bits=4),
}


@contextlib.contextmanager
def simulate(model: Transformer, protocol: QuantizationProtocol) -> Iterator[Transformer]:
    """Yields a weight-quantized copy of `model` whose forward also quantizes activations
    and keys/values (`jaxinfer.models.hooks`); `model` itself is unchanged.

    The hooks belong to the yielded model, so it may be jitted anywhere (inside the block or
    after); the block only scopes the copy.
    """
    quantized = (model if protocol.weight_bits is None else
                 quantize_model_weights(model, protocol.weight_bits, protocol.clip_search))
    activations = (None if protocol.activation_bits is None else
                   lambda x: quantize_asymmetric(x, protocol.activation_bits))
    keys_values = (None if protocol.kv_bits is None else
                   lambda x: quantize_asymmetric(x, protocol.kv_bits, protocol.kv_group_size))
    yield with_activation_hooks(quantized, ActivationHooks(activations, keys_values))
