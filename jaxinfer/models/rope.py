"""Rotary position embeddings (RoPE) with the default, linear and Llama 3 frequency scalings.

The rotation pairs dimension i with dimension i + H/2 ("rotate half"), the convention of the
Hugging Face Llama checkpoints: their q/k projection rows are already permuted for it, so
weights load without reordering.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Returns the RoPE inverse frequencies [H/2] in float32 after scaling.

    Computed on the host with NumPy: it is a constant of the config, folded into the compiled
    program.
    """
    head_dim = config.head_dim
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim  # [H/2]
    inv_freq = 1.0 / (config.rope_theta ** exponents)  # [H/2]
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling.factor, scaling.low_freq_factor,
                                 scaling.high_freq_factor,
                                 scaling.original_max_position_embeddings)
    return inv_freq.astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, factor: float, low_freq_factor: float,
                  high_freq_factor: float, original_max: int) -> np.ndarray:
    # Llama 3.1: long wavelengths (low frequencies) are slowed down by `factor`, short ones are
    # left alone, and the band between is interpolated smoothly in 1/wavelength.
    low_freq_wavelength = original_max / low_freq_factor
    high_freq_wavelength = original_max / high_freq_factor
    wavelength = 2 * math.pi / inv_freq  # [H/2]
    scaled = np.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)  # [H/2]
    smooth = ((original_max / wavelength - low_freq_factor)
              / (high_freq_factor - low_freq_factor))  # [H/2]
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled  # [H/2]
    in_band = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)  # [H/2]
    return np.where(in_band, interpolated, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates queries or keys by their positions.

    Args:
        x: `[B, T, N|K, H]` queries or keys.
        positions: `[B, T]` int32 absolute positions.
        inv_freq: `[H/2]` inverse frequencies from `inverse_frequencies`.

    Returns:
        The rotated array, same shape and dtype as `x`.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(angles)[:, :, None, :]  # [B, T, 1, H/2]
    x32 = x.astype(jnp.float32)  # [B, T, N|K, H]
    first, second = jnp.split(x32, 2, axis=-1)  # [B, T, N|K, H/2] each
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin],
                              axis=-1)  # [B, T, N|K, H]
    return rotated.astype(x.dtype)  # [B, T, N|K, H]
