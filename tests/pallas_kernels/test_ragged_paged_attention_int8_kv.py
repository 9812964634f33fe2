"""The int8 KV cache of ragged paged attention: quantized writes, the reference against
dequantized float pages, the XLA path against the reference, and the quantization error."""

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


def test_quantize_kv_rows_by_hand():
    rows = jnp.asarray([[[127.0, -63.5, 0.0]], [[0.0, 0.0, 0.0]]])  # [2, 1, 3]
    quantized, scales = quantize_kv_rows(rows)
    np.testing.assert_array_equal(np.asarray(scales), [[1.0], [0.0]])
    # -63.5 rounds half to even: -64.
    np.testing.assert_array_equal(np.asarray(quantized), [[[127, -64, 0]], [[0, 0, 0]]])
    assert quantized.dtype == jnp.int8


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_quantized_write_matches_quantizing_the_float_pool(num_tokens):
    rng = np.random.default_rng(num_tokens)
    shape = (4, 4, 2 * 3, 16)  # [P, page_size, 2K, H]
    keys = jnp.asarray(rng.normal(size=(num_tokens, 3, 16)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(num_tokens, 3, 16)) * 5, jnp.float32)
    slots = jnp.asarray(rng.permutation(16)[:num_tokens].astype(np.int32))
    slots = slots.at[0].set(-1) if num_tokens > 1 else slots  # a padding token is dropped
    float_pool = write_to_pages(jnp.zeros(shape), keys, values, slots)
    pages, scales = write_to_quantized_pages(jnp.zeros(shape, jnp.int8),
                                             jnp.zeros(shape[:3], jnp.float32),
                                             keys, values, slots)
    expected_pages, expected_scales = quantize_kv_rows(float_pool)
    np.testing.assert_array_equal(np.asarray(pages), np.asarray(expected_pages))
    np.testing.assert_allclose(np.asarray(scales), np.asarray(expected_scales), rtol=1e-7)
    # Round trip: every element within half a step of its row's scale.
    error = np.abs(np.asarray(dequantize_pages(pages, scales)) - np.asarray(float_pool))
    assert np.all(error <= np.asarray(scales)[..., None] / 2 + 1e-6)


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("seed", range(3))
def test_int8_pool_equals_its_dequantized_float_pool(implementation, seed):
    # Attention over an int8 pool is attention over the float pool it dequantizes to.
    rng = np.random.default_rng(200 + seed)
    query_lens, context_lens = [1, 7, 1, 4], [int(n) for n in rng.integers(1, 30, size=4)]
    context_lens[1] = 0
    longest = max(q + c for q, c in zip(query_lens, context_lens, strict=True))
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size=4,
                           pages_per_seq=-(-longest // 4) + 1, padded_tokens=2, padded_seqs=1)
    pages, scales = quantize_kv_rows(inputs[1])
    dequantized = (inputs[0], dequantize_pages(pages, scales), *inputs[2:])
    quantized = (inputs[0], pages, *inputs[2:])
    for window in (None, 9):
        expected = ragged_paged_attention(*dequantized, sm_scale=0.3, sliding_window=window,
                                          implementation="reference")
        got = ragged_paged_attention(*quantized, sm_scale=0.3, sliding_window=window,
                                     kv_scales=scales, implementation=implementation)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5)


def test_int8_kv_attention_is_close_to_float_attention():
    rng = np.random.default_rng(7)
    inputs, _ = paged_case(rng, [1, 1, 12, 1], [40, 3, 0, 25], page_size=8, pages_per_seq=7,
                           num_kv_heads=2, group=4, head_dim=64)
    pages, scales = quantize_kv_rows(inputs[1])
    exact = np.asarray(ragged_paged_attention(*inputs, sm_scale=0.125, implementation="xla"))
    approximate = np.asarray(ragged_paged_attention(
        inputs[0], pages, *inputs[2:], sm_scale=0.125, kv_scales=scales, implementation="xla"))
    relative = np.abs(approximate - exact).max() / np.abs(exact).max()
    assert 0 < relative < 2e-2, relative
