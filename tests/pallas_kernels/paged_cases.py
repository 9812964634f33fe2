"""Random ragged batches over a shuffled page pool, shared by the attention tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import write_to_pages


def paged_case(rng, query_lens, context_lens, page_size, pages_per_seq, num_kv_heads=2, group=2,
          head_dim=8, padded_tokens=0, padded_seqs=0):
    """Random sequences written into shuffled pages.

    Returns:
        The op's inputs `(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)` and,
        per sequence, `(keys [L, K, H], values [L, K, H], queries [q, N, H], positions [q])`.
    """
    num_heads = num_kv_heads * group
    num_pages = 1 + len(query_lens) * pages_per_seq
    free_pages = list(rng.permutation(np.arange(1, num_pages)))  # page 0 stays a null page
    kv_pages = jnp.zeros((num_pages, page_size, 2 * num_kv_heads, head_dim), jnp.float32)
    page_table = np.zeros((len(query_lens) + padded_seqs, pages_per_seq), np.int32)
    sequences, queries = [], []
    for s, (q_len, context) in enumerate(zip(query_lens, context_lens, strict=True)):
        kv_len = context + q_len
        pages = [free_pages.pop() for _ in range(-(-kv_len // page_size))]
        page_table[s, :len(pages)] = pages
        keys = rng.normal(size=(kv_len, num_kv_heads, head_dim)).astype(np.float32)
        values = rng.normal(size=(kv_len, num_kv_heads, head_dim)).astype(np.float32)
        slots = np.asarray([pages[j // page_size] * page_size + j % page_size
                            for j in range(kv_len)], np.int32)
        kv_pages = write_to_pages(kv_pages, jnp.asarray(keys), jnp.asarray(values),
                                  jnp.asarray(slots))
        q = rng.normal(size=(q_len, num_heads, head_dim)).astype(np.float32)
        queries.append(q)
        sequences.append((keys, values, q, np.arange(context, kv_len)))
    all_queries = np.concatenate(queries + [np.zeros((padded_tokens, num_heads, head_dim),
                                                     np.float32)])
    cu = np.concatenate([[0], np.cumsum(query_lens)] + [[sum(query_lens)]] * padded_seqs)
    kv_lens = np.asarray([c + q for q, c in zip(query_lens, context_lens, strict=True)]
                         + [0] * padded_seqs, np.int32)
    inputs = (jnp.asarray(all_queries), kv_pages, jnp.asarray(kv_lens), jnp.asarray(page_table),
              jnp.asarray(cu, jnp.int32), jnp.asarray([len(query_lens)], jnp.int32))
    return inputs, sequences
