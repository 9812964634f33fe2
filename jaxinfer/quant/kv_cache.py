"""The quantized KV caches' rounding as float functions, and what each cache costs per token.

The engine's 8-bit pools (`EngineConfig.kv_cache_dtype` "int8", "fp8_e4m3", "fp8_e5m2";
`PagedKVCache.create(..., dtype=...)`) store each token's key and value of each KV head in one
byte an element with one float32 scale, symmetric absmax / the dtype's max over head_dim
(`pallas_kernels.ragged_paged_attention.write_to_quantized_pages`). `int8_round_trip` and
`scaled_round_trip` apply the same rounding to float keys and values, so the reference
`generate` (contiguous cache) can run with exactly the precision the engine's cache keeps:

    rounded = with_activation_hooks(model, ActivationHooks(keys_values=int8_round_trip))
    generate(rounded, prompts, ...)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv_formats import SCALED_KV_DTYPES, bytes_per_head_token
from pallas_kernels.ragged_paged_attention.reference import dequantize_pages, quantize_kv_rows


def _scaled_round_trip(x: jax.Array, dtype: str) -> jax.Array:
    # The cache's own quantizer and dequantizer, so the two can never drift apart.
    values, scales = quantize_kv_rows(x, jnp.dtype(dtype))  # [B, T, K, H], [B, T, K]
    return dequantize_pages(values, scales).astype(x.dtype)  # [B, T, K, H]


def int8_round_trip(x: jax.Array) -> jax.Array:
    """Keys or values `[B, T, K, H]` rounded to int8 per token and head and scaled back.

    Returns:
        `[B, T, K, H]` in `x`'s dtype: `round(x / s) * s`, `s = max|x| / 127` over H (an
        all-zero head keeps zeros).
    """
    return _scaled_round_trip(x, "int8")


def scaled_round_trip(kv_cache_dtype: str) -> Callable[[jax.Array], jax.Array]:
    """The per-token-and-head round trip of an 8-bit cache, as a `keys_values` hook.

    Args:
        kv_cache_dtype: "int8", "fp8_e4m3" or "fp8_e5m2".

    Returns:
        A function `[B, T, K, H]` -> `[B, T, K, H]`: each head's row scaled by
        `max|x| / dtype max`, rounded to the dtype's grid, and scaled back.

    Raises:
        ValueError: Not an 8-bit format.
    """
    if kv_cache_dtype not in SCALED_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: one of {tuple(SCALED_KV_DTYPES)}")
    return functools.partial(_scaled_round_trip, dtype=SCALED_KV_DTYPES[kv_cache_dtype])


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str | None = None,
                       page_size: int = 16) -> float:
    """Bytes one token's keys and values take in every layer's cache.

    Args:
        config: The model.
        kv_cache_dtype: "int8" / "fp8_e4m3" / "fp8_e5m2" (one byte per element plus a float32
            scale per token, layer and key or value head), "int4" / "int2" (KIVI: packed
            elements, float16 scale and zero point per page and key channel and per token and
            value group; the float32 residual pool is not counted, see
            `jaxinfer.kv_formats.kivi_residual_bytes`), a float dtype name, or None for the
            model's compute dtype.
        page_size: Tokens per page (KIVI's key scales are shared by a page's tokens).

    Returns:
        The bytes (an int except for KIVI, whose key scales divide over a page).
    """
    per_head = bytes_per_head_token(kv_cache_dtype, config.head_dim, page_size,
                                    float_dtype=config.dtype)
    total = config.num_layers * config.num_kv_heads * per_head
    return int(total) if float(total).is_integer() else total
