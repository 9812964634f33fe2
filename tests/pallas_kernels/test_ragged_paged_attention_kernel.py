"""The ragged paged attention Pallas kernel in TPU interpret mode against the reference, the
reference against a hand-worked case, and our decode path against the upstream paged
attention kernel (a peer, run in interpret mode on the same pages)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import dispatch
from pallas_kernels.ragged_paged_attention import (
    quantize_kv_rows,
    ragged_paged_attention,
    ragged_paged_attention_kernel,
    write_to_pages,
)
from tests.pallas_kernels.interpret import INTERPRET, races_found
from tests.pallas_kernels.paged_cases import paged_case

# (query lens, context lens): decode only, prefill only, and a mix with a chunk whose keys
# reach back past its queries.
BATCHES = {
    "decode": ([1, 1, 1, 1], [5, 17, 1, 30]),
    "prefill": ([9, 3, 14], [0, 0, 0]),
    "mixed": ([1, 12, 1, 6], [20, 0, 9, 11]),
}


def _check(batch, page_size, head_dim, group, num_kv_heads=2, sliding_window=None,
           soft_cap=None, block_tokens=8, pages_per_block=2, seed=0, int8_kv=False,
           kv_dtype=jnp.int8):
    query_lens, context_lens = BATCHES[batch]
    rng = np.random.default_rng(seed)
    longest = max(q + c for q, c in zip(query_lens, context_lens, strict=True))
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size,
                           pages_per_seq=-(-longest // page_size) + 1,
                           num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                           padded_tokens=3, padded_seqs=1)
    kv_scales = None
    if int8_kv:
        # Quantizing every row of the pool is what writing each token quantized would store.
        kv_pages, kv_scales = quantize_kv_rows(inputs[1], kv_dtype)
        inputs = (inputs[0], kv_pages, *inputs[2:])
    scale = head_dim ** -0.5
    expected = ragged_paged_attention(*inputs, sm_scale=scale, sliding_window=sliding_window,
                                      soft_cap=soft_cap, kv_scales=kv_scales,
                                      implementation="reference")
    got = ragged_paged_attention_kernel(*inputs, sm_scale=scale, sliding_window=sliding_window,
                                        soft_cap=soft_cap, kv_scales=kv_scales,
                                        block_tokens=block_tokens,
                                        pages_per_block=pages_per_block, interpret=INTERPRET)
    got, expected = np.asarray(got), np.asarray(expected)
    assert not np.isnan(got).any()
    relative = np.abs(got - expected).max() / np.abs(expected).max()
    assert relative < 1e-5, relative
    assert np.all(got[sum(query_lens):] == 0.0)  # padding tokens
    assert not races_found()


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("page_size", "head_dim", "group"),
                         [(4, 64, 1), (8, 128, 4), (16, 64, 8)])
def test_kernel_matches_the_reference(batch, page_size, head_dim, group):
    _check(batch, page_size, head_dim, group)


@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_kernel_sliding_window_and_soft_cap(batch):
    _check(batch, page_size=4, head_dim=64, group=2, sliding_window=6, soft_cap=3.0)


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("page_size", "head_dim", "group"), [(4, 64, 4), (8, 128, 1)])
def test_kernel_int8_kv_matches_the_reference(batch, page_size, head_dim, group):
    _check(batch, page_size, head_dim, group, int8_kv=True)


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_kernel_fp8_kv_matches_the_reference(batch, kv_dtype):
    # fp8 pages take int8's path (1-byte pages, a scale row per page); only the widening
    # of the page to float32 differs.
    _check(batch, 8, 32, 2, int8_kv=True, kv_dtype=kv_dtype)


def test_kernel_int8_kv_with_sliding_window_and_soft_cap():
    _check("mixed", page_size=4, head_dim=64, group=2, sliding_window=6, soft_cap=3.0,
           int8_kv=True)


@pytest.mark.parametrize("int8_kv", [False, True])
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_kernel_kv_head_counts(num_kv_heads, int8_kv):
    # One KV head (a model's few heads split over tensor parallelism): one program owns the
    # whole head axis and copies it from row 0. Eight: in int8, two programs of four heads
    # each, the second copying from row 8 of the combined head axis.
    _check("mixed", page_size=4, head_dim=64, group=2, num_kv_heads=num_kv_heads,
           int8_kv=int8_kv)


@pytest.mark.slow
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("page_size", [4, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize(("block_tokens", "pages_per_block"), [(8, 1), (16, 4)])
@pytest.mark.parametrize("int8_kv", [False, True])
def test_kernel_grid(batch, page_size, head_dim, group, sliding_window, block_tokens,
                     pages_per_block, int8_kv):
    _check(batch, page_size, head_dim, group, sliding_window=sliding_window,
           block_tokens=block_tokens, pages_per_block=pages_per_block, int8_kv=int8_kv)


def test_public_op_dispatches_to_the_kernel_when_forced():
    rng = np.random.default_rng(3)
    inputs, _ = paged_case(rng, [1, 5], [6, 2], page_size=4, pages_per_seq=3)
    expected = np.asarray(ragged_paged_attention(*inputs, sm_scale=0.3,
                                                 implementation="reference"))
    with dispatch.force_implementation("interpret"):
        assert dispatch.resolve() == "interpret"
        got = np.asarray(ragged_paged_attention(*inputs, sm_scale=0.3))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert dispatch.resolve() == "xla"  # off-TPU default once the override ends
    with pytest.raises(ValueError, match="unknown kernel implementation 'fast'"):
        ragged_paged_attention(*inputs, sm_scale=0.3, implementation="fast")


def test_reference_on_a_hand_worked_case():
    # One sequence, keys k0 = [1, 0] and k1 = [0, 1], values [1, 2] and [3, 4]; the decode
    # query [1, 0] at position 1 sees both: scores [1, 0], weights e/(e+1) and 1/(e+1).
    pages = jnp.zeros((2, 2, 2, 2))  # [P, page_size, 2K, H], K = 1
    keys = jnp.asarray([[[1.0, 0.0]], [[0.0, 1.0]]])  # [T=2, K, H]
    values = jnp.asarray([[[1.0, 2.0]], [[3.0, 4.0]]])
    pages = write_to_pages(pages, keys, values, jnp.asarray([2, 3]))  # page 1
    query = jnp.asarray([[[1.0, 0.0]]])  # [T=1, N=1, H]
    arguments = (query, pages, jnp.asarray([2]), jnp.asarray([[1]]), jnp.asarray([0, 1]),
                 jnp.asarray([1]))
    e = np.e
    expected = np.asarray([(1 * e + 3) / (e + 1), (2 * e + 4) / (e + 1)])
    for implementation in ("reference", "xla"):
        out = ragged_paged_attention(*arguments, sm_scale=1.0, implementation=implementation)
        np.testing.assert_allclose(np.asarray(out)[0, 0], expected, rtol=1e-6)
    out = ragged_paged_attention_kernel(*arguments, sm_scale=1.0, block_tokens=8,
                                        pages_per_block=1, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(out)[0, 0], expected, rtol=1e-6)


def test_decode_matches_the_upstream_paged_attention_kernel():
    # Peer: jax.experimental.pallas.ops.tpu.paged_attention (decode only, separate K and V
    # pools [K, P, page_size, H]) on the same pages, in interpret mode.
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    rng = np.random.default_rng(11)
    page_size, head_dim, num_kv_heads, group = 16, 128, 2, 4
    context_lens = [40, 7, 63, 16]
    inputs, _ = paged_case(rng, [1] * 4, context_lens, page_size, pages_per_seq=4,
                           num_kv_heads=num_kv_heads, group=group, head_dim=head_dim)
    queries, kv_pages, kv_lens, page_indices = inputs[:4]
    # The upstream kernel reads its pages as bfloat16 whatever their dtype, so give both
    # bfloat16-exact pages: the comparison is then of two float32 computations.
    kv_pages = kv_pages.astype(jnp.bfloat16).astype(jnp.float32)
    inputs = (queries, kv_pages, *inputs[2:])
    ours = ragged_paged_attention_kernel(*inputs, sm_scale=1.0, block_tokens=8,
                                         pages_per_block=2, interpret=INTERPRET)
    key_pages = jnp.moveaxis(kv_pages[:, :, 0::2], 2, 0)  # [K, P, page_size, H]
    value_pages = jnp.moveaxis(kv_pages[:, :, 1::2], 2, 0)  # [K, P, page_size, H]
    with pltpu.force_tpu_interpret_mode():
        # The upstream kernel does not scale the queries itself.
        theirs = jax.jit(lambda q, k, v, lens, table: paged_attention(
            q, k, v, lens, table, pages_per_compute_block=2))(
            queries, key_pages, value_pages, kv_lens, page_indices)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)
