"""The ops on a stacked `[L, P, Z, 2K, H]` pool with a `layer` index: each reads and writes
only its layer, gives what the one-layer pool gives, and updates a scan's carried pool in
place (no copy of a layer's pool per layer)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    quantize_kv_rows,
    ragged_paged_attention,
    ragged_paged_attention_kernel,
    write_to_pages,
    write_to_quantized_pages,
)
from tests.pallas_kernels.interpret import INTERPRET, races_found
from tests.pallas_kernels.paged_cases import paged_case

NUM_LAYERS = 3


def _stacked_case(int8_kv: bool, layer: int, seed: int = 0):
    """A mixed ragged batch whose pages sit in `layer` of a stack whose other layers hold
    noise; returns the one-layer inputs, the stacked pool and the scales (one-layer, stacked)."""
    rng = np.random.default_rng(seed)
    inputs, _ = paged_case(rng, [1, 7, 1, 4], [9, 0, 3, 6], page_size=4, pages_per_seq=5,
                           padded_tokens=2, padded_seqs=1)
    pages = inputs[1]  # [P, Z, 2K, H]
    noise = jnp.asarray(rng.normal(size=(NUM_LAYERS, *pages.shape)), jnp.float32)
    stacked = noise.at[layer].set(pages)  # [L, P, Z, 2K, H]
    if not int8_kv:
        return inputs, stacked, None, None
    quantized, scales = quantize_kv_rows(pages)  # [P, Z, 2K, H], [P, Z, 2K]
    stacked_quantized, stacked_scales = quantize_kv_rows(stacked)  # [L, P, Z, 2K(, H)]
    inputs = (inputs[0], quantized, *inputs[2:])
    return inputs, stacked_quantized, scales, stacked_scales


@pytest.mark.parametrize("int8_kv", [False, True])
@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_a_layer_of_the_stack_attends_like_the_one_layer_pool(implementation, int8_kv,
                                                              sliding_window):
    layer = 1
    inputs, stacked, scales, stacked_scales = _stacked_case(int8_kv, layer)
    expected = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=sliding_window,
                                      kv_scales=scales, implementation=implementation)

    @jax.jit
    def attend(pool, pool_scales, index):
        return ragged_paged_attention(inputs[0], pool, *inputs[2:], sm_scale=0.3,
                                      sliding_window=sliding_window, kv_scales=pool_scales,
                                      layer=index, implementation=implementation)

    got = attend(stacked, stacked_scales, jnp.int32(layer))  # a traced layer index
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize("int8_kv", [False, True])
def test_the_kernel_reads_the_layer_it_is_given(int8_kv):
    layer = 2
    inputs, stacked, scales, stacked_scales = _stacked_case(int8_kv, layer, seed=1)
    expected = ragged_paged_attention(*inputs, sm_scale=0.3, kv_scales=scales,
                                      implementation="reference")
    got = ragged_paged_attention_kernel(inputs[0], stacked, *inputs[2:], sm_scale=0.3,
                                        kv_scales=stacked_scales, layer=jnp.int32(layer),
                                        block_tokens=8, pages_per_block=2,
                                        interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=1e-5)
    assert not races_found()


def test_writes_touch_only_their_layer():
    pool = jnp.zeros((NUM_LAYERS, 3, 2, 4, 1))  # [L, P, Z, 2K, H], K = 2
    keys = jnp.asarray([[[1.0], [2.0]], [[5.0], [6.0]]])  # [T=2, K, H]
    out = np.asarray(write_to_pages(pool, keys, keys + 10.0, jnp.asarray([3, -1]), layer=1))
    np.testing.assert_array_equal(out[1, 1, 1, :, 0], [1.0, 11.0, 2.0, 12.0])
    assert np.count_nonzero(out) == 4  # layer 1 only; the padding token wrote nothing

    pages = jnp.zeros((NUM_LAYERS, 3, 2, 4, 1), jnp.int8)
    scales = jnp.zeros((NUM_LAYERS, 3, 2, 4))  # [L, P, Z, 2K]
    pages, scales = write_to_quantized_pages(pages, scales, keys[:1], keys[:1] + 10.0,
                                             jnp.asarray([5]), layer=jnp.int32(2))
    single_pages, single_scales = write_to_quantized_pages(
        jnp.zeros((3, 2, 4, 1), jnp.int8), jnp.zeros((3, 2, 4)), keys[:1], keys[:1] + 10.0,
        jnp.asarray([5]))
    np.testing.assert_array_equal(np.asarray(pages[2]), np.asarray(single_pages))
    np.testing.assert_array_equal(np.asarray(scales[2]), np.asarray(single_scales))
    assert np.count_nonzero(np.asarray(pages[:2])) == 0
    assert np.count_nonzero(np.asarray(scales[:2])) == 0


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_a_scan_updates_its_carried_pool_in_place(num_tokens):
    # The scan writes each layer's rows and attends to them; neither may copy a layer's pool
    # (that would make a step cost the whole pool, whatever its batch).
    num_pages, page_size, num_kv_heads, head_dim = 64, 16, 4, 32
    pool = jnp.zeros((NUM_LAYERS, num_pages, page_size, 2 * num_kv_heads, head_dim))
    keys = jnp.ones((NUM_LAYERS, num_tokens, num_kv_heads, head_dim))  # [L, T, K, H]
    slots = jnp.arange(num_tokens, dtype=jnp.int32) + page_size  # [T] in page 1
    page_indices = jnp.ones((num_tokens, 2), jnp.int32)  # [Q, pages_per_seq], Q = T
    kv_lens = jnp.ones((num_tokens,), jnp.int32)  # [Q]
    cu_q_lens = jnp.arange(num_tokens + 1, dtype=jnp.int32)  # [Q + 1]
    num_seqs = jnp.asarray([num_tokens], jnp.int32)

    def step(pool, keys):
        def layer_body(carry, xs):
            layer, layer_keys = xs
            carry = write_to_pages(carry, layer_keys, layer_keys, slots, layer=layer)
            out = ragged_paged_attention(
                jnp.repeat(layer_keys, 2, axis=1), carry, kv_lens, page_indices, cu_q_lens,
                num_seqs, sm_scale=1.0, layer=layer, implementation="xla")  # [T, N, H]
            return carry, jnp.sum(out)

        return jax.lax.scan(layer_body, pool, (jnp.arange(NUM_LAYERS), keys))

    compiled = jax.jit(step, donate_argnums=0).lower(pool, keys).compile().as_text()
    one_layer = rf"f32\[(?:{num_pages},{page_size}|{num_pages * page_size}),{2 * num_kv_heads}"
    layer_sized = [line for line in compiled.splitlines()
                   if re.search(rf"= {one_layer},{head_dim}\]", line)
                   and ("copy(" in line or "dynamic-slice" in line or "fusion(" in line)]
    assert not layer_sized, layer_sized[:3]
