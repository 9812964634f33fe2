"""The int8 KV cache's rounding as a float function, and what the cache costs per token.

The engine's int8 pool (`PagedKVCache.create(..., dtype="int8")`, `EngineConfig.kv_cache_dtype
="int8"`) stores each token's key and value of each KV head as int8 with one float32 scale,
symmetric absmax / 127 over head_dim (`pallas_kernels.ragged_paged_attention
.write_to_quantized_pages`). `int8_round_trip` applies the same rounding to float keys and
values, so the reference `generate` (contiguous cache) can run with exactly the precision
the engine's cache keeps:

    rounded = with_activation_hooks(model, ActivationHooks(keys_values=int8_round_trip))
    generate(rounded, prompts, ...)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from pallas_kernels.ragged_paged_attention.reference import dequantize_pages, quantize_kv_rows


def int8_round_trip(x: jax.Array) -> jax.Array:
    """Keys or values `[B, T, K, H]` rounded to int8 per token and head and scaled back.

    Returns:
        `[B, T, K, H]` in `x`'s dtype: `round(x / s) * s`, `s = max|x| / 127` over H (an
        all-zero head keeps zeros).
    """
    # The cache's own quantizer and dequantizer, so the two can never drift apart.
    values, scales = quantize_kv_rows(x)  # [B, T, K, H] int8, [B, T, K]
    return dequantize_pages(values, scales).astype(x.dtype)  # [B, T, K, H]


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str | None = None) -> int:
    """Bytes one token's keys and values take in the cache of every layer that has one
    (`config.num_cache_layers`: HARP blocks have none).

    Args:
        config: The model.
        kv_cache_dtype: "int8" (one byte per element plus a float32 scale per token, layer
            and key or value head), a float dtype name, or None for the model's compute dtype.
    """
    elements = 2 * config.num_cache_layers * config.num_kv_heads * config.head_dim
    if kv_cache_dtype == "int8":
        return elements + 4 * 2 * config.num_cache_layers * config.num_kv_heads
    return elements * jnp.dtype(kv_cache_dtype or config.dtype).itemsize
