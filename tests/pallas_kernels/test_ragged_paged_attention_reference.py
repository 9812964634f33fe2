"""Ragged paged attention (the reference and the XLA path) against a per-sequence loop over
contiguous keys, and the XLA path against the reference on random ragged batches."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_to_pages
from tests.pallas_kernels.paged_cases import paged_case


def _loop_attention(queries, keys, values, positions, sliding_window):
    """Plain numpy causal GQA of `[q, N, H]` queries at `positions` over `[k, K, H]` keys."""
    num_heads, num_kv_heads = queries.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros_like(queries)
    for i, position in enumerate(positions):
        for head in range(num_heads):
            k = keys[:, head // group]  # [k, H]
            v = values[:, head // group]
            scores = k @ queries[i, head] / np.sqrt(queries.shape[-1])  # [k]
            visible = np.arange(len(k)) <= position
            if sliding_window is not None:
                visible &= position - np.arange(len(k)) < sliding_window
            scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max())
            out[i, head] = (weights / weights.sum()) @ v
    return out


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("page_size", [4, 16])
def test_mixed_prefill_and_decode_match_the_loop(page_size, sliding_window, implementation):
    rng = np.random.default_rng(page_size)
    # A fresh prefill, a chunk continuing a prefill, two decodes, one 1-token prompt.
    query_lens, context_lens = [9, 6, 1, 1, 1], [0, 7, 20, 3, 0]
    inputs, sequences = paged_case(rng, query_lens, context_lens, page_size,
                              pages_per_seq=-(-27 // page_size), padded_tokens=5,
                              padded_seqs=2)
    out = np.asarray(ragged_paged_attention(*inputs, sm_scale=8 ** -0.5,
                                            sliding_window=sliding_window,
                                            implementation=implementation))
    start = 0
    for keys, values, q, positions in sequences:
        expected = _loop_attention(q, keys, values, positions, sliding_window)
        np.testing.assert_allclose(out[start:start + len(q)], expected, atol=1e-5)
        start += len(q)
    assert np.all(out[start:] == 0.0)  # padding tokens


def test_write_to_pages_interleaves_and_drops_padding():
    pages = jnp.zeros((3, 2, 4, 1))  # [P, page_size, 2K, H], K = 2
    keys = jnp.asarray([[[1.0], [2.0]], [[5.0], [6.0]]])  # [T=2, K, H]
    values = keys + 10.0
    out = np.asarray(write_to_pages(pages, keys, values, jnp.asarray([3, -1])))
    np.testing.assert_array_equal(out[1, 1, :, 0], [1.0, 11.0, 2.0, 12.0])  # slot 3 = (1, 1)
    assert np.count_nonzero(out) == 4  # the padding token wrote nothing


@pytest.mark.parametrize("slot", [5, -1])
def test_write_to_pages_of_one_token(slot):
    pages = jnp.zeros((3, 2, 4, 1))  # [P, page_size, 2K, H]
    keys = jnp.asarray([[[1.0], [2.0]]])  # [T=1, K, H]
    out = np.asarray(write_to_pages(pages, keys, keys + 10.0, jnp.asarray([slot])))
    if slot < 0:
        assert np.count_nonzero(out) == 0
    else:
        np.testing.assert_array_equal(out[2, 1, :, 0], [1.0, 11.0, 2.0, 12.0])
        assert np.count_nonzero(out) == 4


@pytest.mark.parametrize("num_tokens", [1, 2, 16])
def test_write_to_pages_updates_a_donated_pool_in_place(num_tokens):
    # A copy of the pool per step would make every step cost the pool's size (it did for
    # one-token steps: XLA's one-row scatter rewrite copied the pool on CPU).
    pages = jnp.zeros((64, 16, 8, 32))  # [P, page_size, 2K, H]
    keys = jnp.ones((num_tokens, 4, 32))  # [T, K, H]
    slots = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    compiled = jax.jit(write_to_pages, donate_argnums=0).lower(
        pages, keys, keys, slots).compile().as_text()
    pool_copies = re.findall(r"= f32\[(?:64,16,8,32|1024,8,32)\]\{[0-9,]+\} copy\(", compiled)
    assert not pool_copies


def test_unknown_implementation_is_named():
    rng = np.random.default_rng(0)
    inputs, _ = paged_case(rng, [2], [0], page_size=4, pages_per_seq=1)
    with pytest.raises(ValueError, match="unknown kernel implementation"):
        ragged_paged_attention(*inputs, sm_scale=1.0, implementation="magic")


@pytest.mark.parametrize("seed", range(6))
def test_xla_path_equals_the_reference_on_random_ragged_batches(seed):
    rng = np.random.default_rng(100 + seed)
    page_size = int(rng.choice([2, 4, 8]))
    num_seqs = int(rng.integers(1, 6))
    # Each sequence is a decode, a fresh prefill, or a chunk continuing a prefill.
    query_lens, context_lens = [], []
    for kind in rng.integers(0, 3, size=num_seqs):
        context = 0 if kind == 1 else int(rng.integers(1, 30))
        query_lens.append(1 if kind == 0 else int(rng.integers(2, 20)))
        context_lens.append(context)
    longest = max(q + c for q, c in zip(query_lens, context_lens, strict=True))
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size,
                      pages_per_seq=-(-longest // page_size) + 1,
                      num_kv_heads=int(rng.choice([1, 2])), group=int(rng.choice([1, 3])),
                      padded_tokens=int(rng.integers(0, 4)), padded_seqs=int(rng.integers(0, 3)))
    for window in (None, int(rng.integers(1, 25))):
        expected = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=window,
                                          implementation="reference")
        got = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=window,
                                     implementation="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5)


@pytest.mark.parametrize("query_lens", [[300, 1, 150, 7], [1, 1, 129, 127, 2], [512],
                                        [200, 190, 122]])
def test_xla_path_tiles_long_steps_like_the_reference(query_lens):
    # T = 512 takes the tiled path for this step's keys; sequences cross tile boundaries, and
    # chunks with a context walk their pages tile by tile (the last case: three of them).
    rng = np.random.default_rng(sum(query_lens))
    context_lens = [int(rng.integers(1 if len(query_lens) == 3 else 0, 40))
                    for _ in query_lens]
    longest = max(q + c for q, c in zip(query_lens, context_lens, strict=True))
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size=16,
                      pages_per_seq=-(-longest // 16), padded_tokens=512 - sum(query_lens),
                      padded_seqs=1)
    for window in (None, 100):
        expected = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=window,
                                          implementation="reference")
        got = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=window,
                                     implementation="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5)


@pytest.mark.parametrize("num_decodes", [17, 40])
def test_xla_path_walks_decode_groups_of_mixed_lengths_like_the_reference(num_decodes):
    # More decode sequences than one DECODE_SEQUENCE_GROUP (and a ragged last group), with
    # shuffled lengths, mixed with a prefill and a continued chunk.
    rng = np.random.default_rng(num_decodes)
    query_lens = [1] * num_decodes + [9, 5]
    context_lens = [int(n) for n in rng.integers(0, 70, size=num_decodes)] + [0, 33]
    longest = max(q + c for q, c in zip(query_lens, context_lens, strict=True))
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size=4,
                      pages_per_seq=-(-longest // 4), padded_tokens=3, padded_seqs=2)
    for window in (None, 20):
        expected = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=window,
                                          implementation="reference")
        got = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=window,
                                     implementation="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5)


@pytest.mark.parametrize("padded_tokens", [0, 3])
def test_xla_path_walks_short_multi_token_steps_like_the_reference(padded_tokens):
    # Speculative-style steps: k + 1 tokens per sequence over a context (the short-tile walk),
    # beside a longer chunk (the long-tile walk) and a decode; with no padding the last
    # sequence's tile is clamped to the end of the packed tokens.
    rng = np.random.default_rng(padded_tokens)
    query_lens = [5, 5, 1, 8, 12, 5, 2]
    context_lens = [30, 3, 17, 9, 21, 44, 6]
    longest = max(q + c for q, c in zip(query_lens, context_lens, strict=True))
    inputs, _ = paged_case(rng, query_lens, context_lens, page_size=4,
                           pages_per_seq=-(-longest // 4), padded_tokens=padded_tokens,
                           padded_seqs=1)
    for window in (None, 10):
        expected = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=window,
                                          implementation="reference")
        got = ragged_paged_attention(*inputs, sm_scale=0.3, sliding_window=window,
                                     implementation="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5)
