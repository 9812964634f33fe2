"""Outlier metrics of a model's hidden states: OSP's excess kurtosis and max|h| / RMS(h).

The excess kurtosis of a token vector x in R^D (METHODS.md section 3) is

    k(x) = max(0, mean(x^4) / std(x)^4 - 3)

with the raw (uncentered) fourth moment and the unbiased (ddof = 1) standard deviation. A
Gaussian vector scores ~0; a vector with a few huge channels (the "massive activations" that
break 4-bit quantization) scores up to ~D. The model's score averages k over every token of
every hidden state the outlier literature looks at: the embedding output, each block's
residual stream, and the final normed output.

Two variants, always labelled: "length_one" feeds every token as its own length-1 sequence,
as the paper's script did (no attention context, so no attention-sink outliers); "in_context"
runs the real sequences.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.models import Transformer

VARIANTS = ("length_one", "in_context")


def excess_kurtosis(x: jax.Array) -> jax.Array:
    """Per-vector excess kurtosis over the last axis.

    Args:
        x: `[..., D]` token vectors, D >= 2.

    Returns:
        `[...]` float32, each >= 0.
    """
    x = x.astype(jnp.float32)  # [..., D]
    fourth_moment = jnp.mean(x ** 4, axis=-1)  # [...]
    variance = jnp.var(x, axis=-1, ddof=1)  # [...]
    return jnp.maximum(0.0, fourth_moment / jnp.maximum(variance, 1e-30) ** 2 - 3.0)


@nnx.jit
def _statistics(model: Transformer, token_ids: jax.Array) -> dict[str, jax.Array]:
    positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1], dtype=jnp.int32),
                                 token_ids.shape)  # [B, T]
    states: list[jax.Array] = []
    model.hidden_states(token_ids, positions, intermediates=states)
    stacked = jnp.stack(states).astype(jnp.float32)  # [L + 2, B, T, D]
    kurtosis = excess_kurtosis(stacked)  # [L + 2, B, T]
    rms = jnp.sqrt(jnp.mean(jnp.square(stacked), axis=(1, 2, 3)))  # [L + 2]
    peak = jnp.max(jnp.abs(stacked), axis=(1, 2, 3))  # [L + 2]
    return {"kurtosis_per_state": jnp.mean(kurtosis, axis=(1, 2)),  # [L + 2]
            "max_over_rms_per_state": peak / rms}  # [L + 2]


def outlier_statistics(model: Transformer, token_ids: jax.Array,
                       variant: str = "in_context") -> dict[str, Any]:
    """Excess kurtosis and max|h| / RMS(h) of every hidden state, on `token_ids`.

    Args:
        model: The model (OSP parts folded or not; the metric is the same function).
        token_ids: `[B, T]` int32 held-out text.
        variant: "in_context" (the sequences as given) or "length_one" (every token alone,
            at position 0).

    Returns:
        {"variant", "excess_kurtosis" (the mean over all states and tokens),
         "kurtosis_per_state" and "max_over_rms_per_state" (lists of L + 2 floats: embedding
         output, each block's output, final norm output)}.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant = {variant!r}: expected one of {VARIANTS}")
    if variant == "length_one":
        token_ids = token_ids.reshape(-1, 1)  # [B * T, 1]
    result = jax.device_get(_statistics(model, token_ids))
    per_state = [float(value) for value in result["kurtosis_per_state"]]
    return {"variant": variant,
            "excess_kurtosis": sum(per_state) / len(per_state),
            "kurtosis_per_state": per_state,
            "max_over_rms_per_state": [float(v) for v in result["max_over_rms_per_state"]]}
