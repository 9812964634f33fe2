"""The model over the engine's paged cache equals the plain forward pass, chunk by chunk."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.models import PagedBatch, PagedKVCache, create_model

PAGE_SIZE = 4
PAGES_PER_SEQ = 4


def _step(model, cache, chunks, page_tables, kv_lens_before, pad_tokens=3, pad_seqs=1):
    """Runs one ragged step: chunks[s] are the new tokens of sequence s."""
    tokens, positions, slots, cu = [], [], [], [0]
    for s, chunk in enumerate(chunks):
        for offset, token in enumerate(chunk):
            position = kv_lens_before[s] + offset
            tokens.append(token)
            positions.append(position)
            slots.append(page_tables[s][position // PAGE_SIZE] * PAGE_SIZE
                         + position % PAGE_SIZE)
        cu.append(len(tokens))
    real = len(tokens)
    tokens += [0] * pad_tokens
    positions += [0] * pad_tokens
    slots += [-1] * pad_tokens
    cu += [real] * pad_seqs
    kv_lens = [before + len(chunk) for before, chunk in zip(kv_lens_before, chunks,
                                                            strict=True)] + [0] * pad_seqs
    tables = np.zeros((len(chunks) + pad_seqs, PAGES_PER_SEQ), np.int32)
    for s, table in enumerate(page_tables):
        tables[s, :len(table)] = table
    batch = PagedBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                       jnp.asarray(tables), jnp.asarray(cu, jnp.int32),
                       jnp.asarray([len(chunks)], jnp.int32))
    logits, cache = model(jnp.asarray([tokens], jnp.int32),
                          jnp.asarray([positions], jnp.int32), cache._replace(batch=batch))
    return np.asarray(logits[0, :real]), cache, cu


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_chunked_paged_steps_equal_the_full_forward(sliding_window):
    config = get_preset("tiny").replace(sliding_window=sliding_window)
    model = create_model(config, seed=0)
    rng = np.random.default_rng(0)
    sequences = [list(rng.integers(3, config.vocab_size, size=n)) for n in (7, 5, 9)]
    page_tables = [[5, 2], [7, 1], [3, 8, 4]]  # shuffled physical pages; page 0 unused
    empty = PagedBatch(*(jnp.zeros((1,), jnp.int32) for _ in range(5)))
    cache = PagedKVCache.create(config, num_pages=9, page_size=PAGE_SIZE, batch=empty)

    # Step 1: prefill chunks of different lengths. Step 2: the rest, mixed with a decode.
    schedule = [[4, 5, 2], [3, 0, 7]]
    done = [0, 0, 0]
    got = [[] for _ in sequences]
    for lengths in schedule:
        active = [s for s, n in enumerate(lengths) if n]
        chunks = [sequences[s][done[s]:done[s] + lengths[s]] for s in active]
        logits, cache, cu = _step(model, cache, chunks, [page_tables[s] for s in active],
                                  [done[s] for s in active])
        for index, s in enumerate(active):
            got[s].append(logits[cu[index]:cu[index + 1]])
            done[s] += lengths[s]
    for s, sequence in enumerate(sequences):
        expected, _ = model(jnp.asarray([sequence], jnp.int32))  # [1, T, V]
        np.testing.assert_allclose(np.concatenate(got[s]), np.asarray(expected[0]),
                                   atol=2e-5, rtol=0)
