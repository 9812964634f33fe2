"""SmoothQuant W8A8 ("SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models", arXiv 2211.10438), METHODS.md section 1.

Activation outliers live in a few input channels; weights are easy to quantize. Per input
channel j of a linear layer, with `max|X_j|` over calibration tokens and `max|W_j|` over the
weight's row j (all layers sharing that input together),

    s_j = max|X_j|^a / max|W_j|^(1 - a)        (a = `smoothquant_alpha`, 0.5 by default)

and `X W = (X / s)(s W)`: the activations are divided by s, the weight rows multiplied by s,
which moves quantization difficulty from activations to weights. Then every linear layer runs
W8A8: int8 per-token activations times int8 per-output-channel weights.

The division by s is folded into whatever produces the activation, so it costs nothing:

- q/k/v input: the block's input RMSNorm gain (`g / s`);
- gate/up input: the post-attention RMSNorm gain;
- down_proj input `silu(gate) * up`: up_proj's output columns (`up / s`), exact because the
  product is elementwise.

o_proj's input (the attention output) has no per-channel producer to fold into without
tying scales across the query heads of a KV group, so o_proj is quantized W8A8 unsmoothed.
Single-scale RMSNorm (OSP) has a scalar gain, which cannot absorb a per-channel s: blocks
with one keep their q/k/v and gate/up unsmoothed (still W8A8).

Statistics come from the float model on the calibration windows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models import Transformer
from jaxinfer.models.layers import RMSNorm
from jaxinfer.quant.calibration import collect_block_inputs
from jaxinfer.quant.config import QuantizationConfig
from jaxinfer.quant.linear import LinearSite, copy_model, linear_sites, quantize_model

# Floor on max|X| and max|W| so a dead channel gives a finite, harmless factor.
_FLOOR = 1e-5


def smoothing_factors(activation_max: jax.Array, weight_max: jax.Array,
                      alpha: float) -> jax.Array:
    """`s = max|X|^a / max|W|^(1-a)` per input channel, from two `[I]` maxima: `[I]`."""
    activation_max = jnp.maximum(activation_max, _FLOOR)  # [I]
    weight_max = jnp.maximum(weight_max, _FLOOR)  # [I]
    return activation_max ** alpha / weight_max ** (1.0 - alpha)  # [I]


def _row_max(sites: list[LinearSite]) -> jax.Array:
    """`max|W_j|` over input row j of every listed `[I, O]` weight: `[I]`."""
    return jnp.max(jnp.stack([jnp.max(jnp.abs(site.float_matrix().astype(jnp.float32)),
                                      axis=1) for site in sites]), axis=0)  # [I]


def _scale_rows(site: LinearSite, factors: jax.Array) -> None:
    matrix = site.float_matrix().astype(jnp.float32)  # [I, O]
    site.set_float_matrix(matrix * factors[:, None])


def _fold_into_norm(norm: RMSNorm, factors: jax.Array) -> bool:
    """`g / s` into a per-channel gain; False (nothing changed) for a single-scale norm."""
    gain = norm.weight[...]  # [D] or [1]
    if gain.shape != factors.shape:
        return False
    norm.weight[...] = (gain.astype(jnp.float32) / factors).astype(gain.dtype)
    return True


def smooth_model(model: Transformer, windows: np.ndarray, alpha: float) -> Transformer:
    """A float copy of `model` with the smoothing folded in; its outputs equal the
    original's up to float rounding (the transform is exact in real arithmetic).

    Args:
        model: A dense float model (left unchanged).
        windows: `[B, T]` calibration token ids.
        alpha: Migration strength a in [0, 1].
    """
    model = copy_model(model)
    inputs = collect_block_inputs(model, windows)  # per block: site -> [B * T, I]
    sites = {site.path: site for site in linear_sites(model)}
    for index, block in enumerate(model.layers):
        prefix = f"layers.{index}"
        activation_max = {site: jnp.max(jnp.abs(x.astype(jnp.float32)), axis=0)
                          for site, x in inputs[index].items()}  # site -> [I]
        attention = [sites[f"{prefix}.attention.{name}"] for name in ("q_proj", "k_proj",
                                                                      "v_proj")]
        factors = smoothing_factors(activation_max["attention_input"], _row_max(attention),
                                    alpha)  # [D]
        if _fold_into_norm(block.input_norm, factors):
            for site in attention:
                _scale_rows(site, factors)
        mlp_in = [sites[f"{prefix}.mlp.{name}"] for name in ("gate_proj", "up_proj")]
        factors = smoothing_factors(activation_max["mlp_input"], _row_max(mlp_in), alpha)  # [D]
        if _fold_into_norm(block.post_attention_norm, factors):
            for site in mlp_in:
                _scale_rows(site, factors)
        down, up = sites[f"{prefix}.mlp.down_proj"], sites[f"{prefix}.mlp.up_proj"]
        factors = smoothing_factors(activation_max["mlp_hidden"], _row_max([down]), alpha)  # [F]
        _scale_rows(down, factors)
        up.set_float_matrix(up.float_matrix().astype(jnp.float32) / factors[None, :])
    return model


def smoothquant_model(model: Transformer, config: QuantizationConfig, windows: np.ndarray, *,
                      implementation: str = "auto") -> Transformer:
    """Smooths `model` on the calibration windows, then quantizes it by `config`'s rules
    (W8A8 for every linear layer by default)."""
    smoothed = smooth_model(model, windows, config.smoothquant_alpha)
    return quantize_model(smoothed, config, implementation=implementation)
