"""The quantized KV caches' rounding as float functions, and what each cache costs per token.

The engine's 8-bit pools (`EngineConfig.kv_cache_dtype` "int8", "fp8_e4m3", "fp8_e5m2";
`PagedKVCache.create(..., dtype=...)`) store each token's key and value of each KV head in one
byte an element with one float32 scale, symmetric absmax / the dtype's max over head_dim
(`pallas_kernels.ragged_paged_attention.write_to_quantized_pages`). `int8_round_trip` and
`scaled_round_trip` apply the same rounding to float keys and values, so the reference
`generate` (contiguous cache) can run with exactly the precision the engine's cache keeps:

    rounded = with_activation_hooks(model, ActivationHooks(keys_values=int8_round_trip))
    generate(rounded, prompts, ...)

KIVI's pools ("int4", "int2") round keys per channel over a page of tokens and values per token
in channel groups, and keep the partial last page exact, so their rounding depends on where a
token sits in its sequence: `kivi_round_trip` gives it for whole sequences from position 0 (a
`key_value_pair` hook of a cache-free forward, e.g. `perplexity`'s default path, equals the
paged path's single prefill per window), with a residual window to vary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv_formats import KIVI_BITS, SCALED_KV_DTYPES, bytes_per_head_token, kivi_value_group
from pallas_kernels.ragged_paged_attention.kivi import dequantize, quantize_pages
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


def _kivi_round_trip(keys: jax.Array, values: jax.Array, bits: int, page_size: int,
                     residual: int) -> tuple[jax.Array, jax.Array]:
    batch, length, num_kv_heads, head_dim = keys.shape
    # KIVI keeps the newest `length % residual` tokens exact (none with residual 0).
    rounded_length = length - length % residual if residual else length
    padded = -(-length // page_size) * page_size
    rows = jnp.stack([keys, values], axis=3).reshape(
        batch, length, 2 * num_kv_heads, head_dim).astype(jnp.float32)  # [B, T, 2K, H]
    # Repeating the last row fills a short last group without moving its min or max.
    rows_padded = jnp.pad(rows, ((0, 0), (0, padded - length), (0, 0), (0, 0)), mode="edge")
    pages = rows_padded.reshape(batch * padded // page_size, page_size, 2 * num_kv_heads,
                                head_dim)  # [B * T'/Z, Z, 2K, H]
    back = dequantize(*quantize_pages(pages, bits, kivi_value_group(head_dim)), bits)
    back = back.reshape(batch, padded, 2 * num_kv_heads, head_dim)[:, :length]  # [B, T, 2K, H]
    rounded = jnp.arange(length) < rounded_length  # [T]
    mixed = jnp.where(rounded[None, :, None, None], back, rows)  # [B, T, 2K, H]
    return (mixed[:, :, 0::2].astype(keys.dtype),  # [B, T, K, H]
            mixed[:, :, 1::2].astype(values.dtype))


def kivi_round_trip(kv_cache_dtype: str, page_size: int = 16, residual: int | None = None
                    ) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """KIVI's rounding of whole sequences, as a `key_value_pair` hook.

    The keys and values `[B, T, K, H]` of each row are a sequence from position 0: keys are
    rounded per channel over each run of `page_size` tokens, values per token in groups of
    `kivi_value_group(H)` channels (the engine's pool rounds exactly so), except the newest
    `T % residual` tokens, kept exact (KIVI's residual window).

    Args:
        kv_cache_dtype: "int4" or "int2".
        page_size: Tokens per key group (the engine's page size).
        residual: The residual window, a multiple of `page_size`; None: `page_size`, what
            the engine's pool keeps (its partial last page); 0: every token rounded (a short
            last group rounds on its own).

    Returns:
        `(keys, values) -> (keys, values)`, shapes and dtypes kept.

    Raises:
        ValueError: Not a KIVI format, or a residual that is not a multiple of the page.
    """
    if kv_cache_dtype not in KIVI_BITS:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: one of {tuple(KIVI_BITS)}")
    residual = page_size if residual is None else residual
    if residual < 0 or residual % page_size:
        raise ValueError(f"residual {residual}: a multiple of the page size {page_size}")
    return functools.partial(_kivi_round_trip, bits=KIVI_BITS[kv_cache_dtype],
                             page_size=page_size, residual=residual)


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str | None = None,
                       page_size: int = 16) -> float:
    """Bytes one token's keys and values take in the cache of every layer that has one
    (`config.num_cache_layers`: HARP blocks have none).

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
    total = config.num_cache_layers * config.num_kv_heads * per_head
    return int(total) if float(total).is_integer() else total
