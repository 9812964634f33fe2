"""The 8-bit KV caches (int8, fp8 e4m3, fp8 e5m2) of ragged paged attention: quantized writes,
the reference against dequantized float pages, the XLA path (and on CPU its C++ decode walk)
against the reference, and the quantization error."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    dequantize_pages,
    quantize_kv_rows,
    ragged_paged_attention,
    write_to_pages,
    write_to_quantized_pages,
)
from tests.pallas_kernels.paged_cases import paged_case

DTYPES = [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2]


def test_quantize_kv_rows_by_hand():
    rows = jnp.asarray([[[127.0, -63.5, 0.0]], [[0.0, 0.0, 0.0]]])  # [2, 1, 3]
    quantized, scales = quantize_kv_rows(rows)
    np.testing.assert_array_equal(np.asarray(scales), [[1.0], [0.0]])
    # -63.5 rounds half to even: -64.
    np.testing.assert_array_equal(np.asarray(quantized), [[[127, -64, 0]], [[0, 0, 0]]])
    assert quantized.dtype == jnp.int8


def test_fp8_rows_by_hand():
    rows = jnp.asarray([[448.0, -100.0, 0.3, 0.0]])  # [1, 4]
    quantized, scales = quantize_kv_rows(rows, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(scales), [1.0])  # absmax 448 / e4m3's max 448
    # e4m3 keeps 3 mantissa bits: 100 -> 96 (steps of 8 in [64, 128)); 0.3 -> 0.3125.
    np.testing.assert_array_equal(np.asarray(quantized, np.float32), [[448.0, -96.0, 0.3125, 0]])
    quantized, scales = quantize_kv_rows(rows * 2, jnp.float8_e5m2)
    np.testing.assert_allclose(np.asarray(scales), [896.0 / 57344.0])
    assert quantized.dtype == jnp.float8_e5m2
    np.testing.assert_array_equal(np.asarray(quantized, np.float32)[0, 0], 57344.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_quantized_write_matches_quantizing_the_float_pool(num_tokens, dtype):
    rng = np.random.default_rng(num_tokens)
    shape = (4, 4, 2 * 3, 16)  # [P, page_size, 2K, H]
    keys = jnp.asarray(rng.normal(size=(num_tokens, 3, 16)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(num_tokens, 3, 16)) * 5, jnp.float32)
    slots = jnp.asarray(rng.permutation(16)[:num_tokens].astype(np.int32))
    slots = slots.at[0].set(-1) if num_tokens > 1 else slots  # a padding token is dropped
    float_pool = write_to_pages(jnp.zeros(shape), keys, values, slots)
    pages, scales = write_to_quantized_pages(jnp.zeros(shape, dtype),
                                             jnp.zeros(shape[:3], jnp.float32),
                                             keys, values, slots)
    expected_pages, expected_scales = quantize_kv_rows(float_pool, dtype)
    assert pages.dtype == dtype
    np.testing.assert_array_equal(np.asarray(pages, np.float32),
                                  np.asarray(expected_pages, np.float32))
    np.testing.assert_allclose(np.asarray(scales), np.asarray(expected_scales), rtol=1e-7)
    error = np.abs(np.asarray(dequantize_pages(pages, scales)) - np.asarray(float_pool))
    if dtype == jnp.int8:
        # Every element within half a step of its row's scale.
        bound = np.asarray(scales)[..., None] / 2 + 1e-6
    else:
        # Within half an ulp of the element's binade (2^-4 relative for e4m3, 2^-3 for e5m2;
        # the smallest normal sets the floor for tiny elements).
        info = jnp.finfo(dtype)
        relative = 2.0 ** -(info.nmant + 1)
        bound = (relative * np.abs(np.asarray(float_pool))
                 + np.asarray(scales)[..., None] * float(info.smallest_subnormal) + 1e-6)
    assert np.all(error <= bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("seed", range(3))
def test_8bit_pool_equals_its_dequantized_float_pool(implementation, seed, dtype):
    # Attention over an 8-bit pool is attention over the float pool it dequantizes to; the
    # XLA path's decode walk is the C++ kernel on CPU.
    rng = np.random.default_rng(200 + seed)
    query_lens, context_lens = [1, 7, 1, 4], [int(n) for n in rng.integers(1, 30, size=4)]
    context_lens[1] = 0
    longest = max(q + c for q, c in zip(query_lens, context_lens, strict=True))
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size=4,
                           pages_per_seq=-(-longest // 4) + 1, padded_tokens=2, padded_seqs=1)
    pages, scales = quantize_kv_rows(inputs[1], dtype)
    dequantized = (inputs[0], dequantize_pages(pages, scales), *inputs[2:])
    quantized = (inputs[0], pages, *inputs[2:])
    for window in (None, 9):
        expected = ragged_paged_attention(*dequantized, sm_scale=0.3, sliding_window=window,
                                          implementation="reference")
        got = ragged_paged_attention(*quantized, sm_scale=0.3, sliding_window=window,
                                     kv_scales=scales, implementation=implementation)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5)


@pytest.mark.parametrize(("dtype", "tolerance"),
                         [(jnp.int8, 2e-2), (jnp.float8_e4m3fn, 6e-2), (jnp.float8_e5m2, 1.2e-1)])
def test_8bit_kv_attention_is_close_to_float_attention(dtype, tolerance):
    rng = np.random.default_rng(7)
    inputs, _ = paged_case(rng, [1, 1, 12, 1], [40, 3, 0, 25], page_size=8, pages_per_seq=7,
                           num_kv_heads=2, group=4, head_dim=64)
    pages, scales = quantize_kv_rows(inputs[1], dtype)
    exact = np.asarray(ragged_paged_attention(*inputs, sm_scale=0.125, implementation="xla"))
    approximate = np.asarray(ragged_paged_attention(
        inputs[0], pages, *inputs[2:], sm_scale=0.125, kv_scales=scales, implementation="xla"))
    relative = np.abs(approximate - exact).max() / np.abs(exact).max()
    assert 0 < relative < tolerance, relative
