"""The KV cache's storage formats and what each costs per token (no jax: the memory planner and
the config use it).

Formats (`EngineConfig.kv_cache_dtype`, `jaxinfer serve --kv-cache-dtype`):

- None / a float dtype: the pages hold keys and values as they are (2 or 4 bytes an element).
- "int8", "fp8_e4m3", "fp8_e5m2": one byte an element, symmetric, one float32 scale per token
  and key or value head (`absmax / 127`, `/ 448`, `/ 57344`).
- "int4", "int2": KIVI (Liu et al. 2024, arXiv 2402.02750), asymmetric (float16 scale and zero
  point): keys per channel over a page's Z tokens, values per token in groups of
  `KIVI_VALUE_GROUP` channels; 2 or 4 values packed per byte. The last, partly filled page of
  each running sequence stays in a float32 residual pool (one page per sequence seat) until it
  fills, so the newest 0..Z-1 tokens are exact (`docs/kv_cache.md`).
"""

from __future__ import annotations

KV_CACHE_DTYPES = (None, "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")
# The 8-bit formats with a float32 scale per token and head, and their jnp dtype names.
SCALED_KV_DTYPES = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# KIVI formats and their bits per element.
KIVI_BITS = {"int4": 4, "int2": 2}
# Channels per value group (KIVI's G = 32), or the head dim when that is smaller.
KIVI_VALUE_GROUP = 32
KIVI_SCALE_BYTES = 2  # float16 scales and zero points, as KIVI keeps them
SCALE_BYTES = 4  # the 8-bit formats' float32 scales
_FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "fp32": 4}


def kivi_value_group(head_dim: int) -> int:
    """Channels per value quantization group for this head dim."""
    return min(KIVI_VALUE_GROUP, head_dim)


def bytes_per_head_token(kv_cache_dtype: str | None, head_dim: int, page_size: int = 16,
                         float_dtype: str = "bfloat16") -> float:
    """Bytes one token's key and value of one KV head take in one layer's pool.

    Args:
        kv_cache_dtype: One of `KV_CACHE_DTYPES`, or a float dtype name.
        head_dim: H.
        page_size: Tokens per page (KIVI's key group: a page's key scales are shared by its Z
            tokens).
        float_dtype: The dtype of a float pool (`kv_cache_dtype` None).

    Returns:
        Bytes (fractional for KIVI: a page's key scales divided over its tokens), scales and
        zero points included, the residual pool not (`kivi_residual_bytes`).

    Raises:
        ValueError: An unknown format.
    """
    if kv_cache_dtype in SCALED_KV_DTYPES:
        return 2 * (head_dim + SCALE_BYTES)
    if kv_cache_dtype in KIVI_BITS:
        packed = head_dim * KIVI_BITS[kv_cache_dtype] / 8
        key_scales = 2 * head_dim * KIVI_SCALE_BYTES / page_size  # scale + zero per channel
        value_scales = 2 * (head_dim // kivi_value_group(head_dim)) * KIVI_SCALE_BYTES
        return 2 * packed + key_scales + value_scales
    name = kv_cache_dtype or float_dtype
    if name not in _FLOAT_BYTES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; known: "
                         f"{KV_CACHE_DTYPES[1:]} or a float dtype")
    return 2 * head_dim * _FLOAT_BYTES[name]


def kivi_residual_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                        num_seats: int) -> int:
    """Bytes of a KIVI pool's float32 residual pool: one page per sequence seat."""
    return num_layers * num_seats * page_size * 2 * num_kv_heads * head_dim * 4
