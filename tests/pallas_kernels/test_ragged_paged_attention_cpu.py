"""The C++ decode kernel of the XLA:CPU path against the readable reference and the XLA loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    cpu,
    quantize_kv_rows,
    ragged_paged_attention,
)
from tests.pallas_kernels.paged_cases import paged_case

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernel")


def test_the_kernel_builds_here_and_the_xla_path_calls_it():
    assert cpu.available()
    rng = np.random.default_rng(0)
    inputs, _ = paged_case(rng, [1, 1], [5, 9], page_size=4, pages_per_seq=4)
    text = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.3, implementation="xla")
                   ).lower(*inputs).as_text()
    assert "jaxinfer_DecodeAttentionF32" in text
    with cpu.disabled():
        text = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.3,
                                                         implementation="xla")
                       ).lower(*inputs).as_text()
    assert "jaxinfer_DecodeAttention" not in text


# A covering set: every pool dtype with each masking variant, and every GQA group and page
# size once (the kernel's loops do not depend on how these combine).
CASES = [(pool, window, soft_cap, 2, 4) for pool in ("float32", "bfloat16", "int8")
         for window, soft_cap in ((None, None), (6, None), (None, 5.0))]
CASES += [("float32", None, None, 1, 8), ("int8", 6, None, 4, 16), ("float32", None, None, 8, 16)]
# The float8 pools (rows widened 16 at a time by F16C, `WidenRow`), once each.
CASES += [("float8_e4m3fn", None, None, 2, 4), ("float8_e5m2", 6, None, 2, 4)]


@pytest.mark.parametrize(("pool", "window", "soft_cap", "group", "page_size"), CASES)
def test_kernel_equals_the_reference_and_the_xla_loop(pool, window, soft_cap, group,
                                                      page_size):
    rng = np.random.default_rng(hash((pool, window, soft_cap, group)) % 2**32)
    # Decode rows (q_len 1) with and without context, a prefill chunk and a padded row.
    query_lens = [1, 1, 6, 1, 1]
    context_lens = [int(n) for n in rng.integers(1, 40, size=5)]
    context_lens[3] = 0
    longest = max(q + c for q, c in zip(query_lens, context_lens, strict=True))
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size=page_size,
                           pages_per_seq=-(-longest // page_size) + 1, group=group,
                           head_dim=16, padded_tokens=3, padded_seqs=1)
    queries, kv_pages, *rest = inputs
    kv_scales = None
    if pool in ("int8", "float8_e4m3fn", "float8_e5m2"):
        kv_pages, kv_scales = quantize_kv_rows(kv_pages, jnp.dtype(pool))
    elif pool == "bfloat16":
        kv_pages = kv_pages.astype(jnp.bfloat16)

    def attend(implementation: str) -> np.ndarray:
        return np.asarray(ragged_paged_attention(
            queries, kv_pages, *rest, sm_scale=0.25, sliding_window=window,
            soft_cap=soft_cap, kv_scales=kv_scales, implementation=implementation))

    kernel = attend("xla")
    with cpu.disabled():
        loop = attend("xla")
    reference = attend("reference")
    np.testing.assert_allclose(kernel, reference, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(kernel, loop, atol=2e-5, rtol=2e-5)


def test_a_layer_of_a_stacked_pool():
    rng = np.random.default_rng(7)
    inputs, _ = paged_case(rng, [1, 1, 1], [30, 3, 17], page_size=4, pages_per_seq=9)
    queries, kv_pages, *rest = inputs
    other = jnp.asarray(rng.normal(size=kv_pages.shape), jnp.float32)
    stacked = jnp.stack([other, kv_pages, other])  # [L, P, Z, 2K, H]
    got = ragged_paged_attention(queries, stacked, *rest, sm_scale=0.3, layer=1,
                                 implementation="xla")
    expected = ragged_paged_attention(queries, kv_pages, *rest, sm_scale=0.3,
                                      implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


def test_float32_pages_of_many_keys_and_wide_heads_take_the_vector_scores():
    # Pages of 32 keys (two 16-key score blocks, the second partly filled) and head_dim 64
    # (four 16-lane chunks): the vectorized score path against the reference.
    rng = np.random.default_rng(7)
    query_lens, context_lens = [1, 1, 1, 3], [45, 32, 7, 20]
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size=32, pages_per_seq=3,
                           group=2, head_dim=64)
    kernel = np.asarray(ragged_paged_attention(*inputs, sm_scale=0.125, implementation="xla"))
    reference = np.asarray(ragged_paged_attention(*inputs, sm_scale=0.125,
                                                  implementation="reference"))
    np.testing.assert_allclose(kernel, reference, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("pool", ["float8_e4m3fn", "float8_e5m2"])
def test_every_float8_value_widens_exactly(pool):
    # Every key and value row holds every finite byte of the dtype (NaN and infinity codes
    # set to 0): the scores are all equal, so attention returns the value row, and the
    # kernel's widened values must match the dtype's own conversion for all of them, through
    # the 16-wide F16C path and (head_dim 264 = 16 * 16 + 8) the scalar tail.
    head_dim = 264
    codes = np.arange(head_dim) % 256
    finite = np.isfinite(np.asarray(jax.lax.bitcast_convert_type(
        jnp.asarray(codes, jnp.uint8), jnp.dtype(pool)).astype(jnp.float32)))
    codes = np.where(finite, codes, 0).astype(np.uint8)
    row = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.dtype(pool))  # [H]
    rng = np.random.default_rng(0)
    inputs, _ = paged_case(rng, [1], [1], page_size=4, pages_per_seq=2, group=1,
                           head_dim=head_dim, padded_tokens=0, padded_seqs=0)
    queries, kv_pages, *rest = inputs
    pool_pages = jnp.broadcast_to(row, kv_pages.shape)  # every key and value row = all codes
    kv_scales = jnp.ones(kv_pages.shape[:-1], jnp.float32)

    def attend(implementation: str) -> np.ndarray:
        return np.asarray(ragged_paged_attention(
            queries, pool_pages, *rest, sm_scale=0.25, kv_scales=kv_scales,
            implementation=implementation))

    # Equal up to the softmax weights' sum (1 within an ulp); a wrong code is off by far more.
    np.testing.assert_allclose(attend("xla"), attend("reference"), rtol=1e-6, atol=0)
