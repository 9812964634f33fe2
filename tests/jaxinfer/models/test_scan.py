"""Scan over layers: the stacked copy of a model gives the layer loop's logits and pages over
the engine's paged cache (float and int8 pages, GQA, sliding window, tensor parallel on
simulated devices), and blocks that differ or carry hooks are not stacked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.config import get_preset
from jaxinfer.models import KVCache, PagedBatch, PagedKVCache, create_model
from jaxinfer.models.hooks import ActivationHooks, with_activation_hooks
from jaxinfer.models.scan import stack_layers, uniform_block_graphdef
from jaxinfer.sharding import activate, make_mesh

PAGE_SIZE = 4
PAGES_PER_SEQ = 6


def _batch(chunks, tables, before, pad_tokens=3, pad_seqs=1):
    """One ragged step: `chunks[s]` are sequence s's new tokens after `before[s]` cached ones.

    Returns `[1, T]` tokens and positions and the step's `PagedBatch`."""
    tokens, positions, slots, cu = [], [], [], [0]
    for chunk, table, start in zip(chunks, tables, before, strict=True):
        for offset, token in enumerate(chunk):
            position = start + offset
            tokens.append(token)
            positions.append(position)
            slots.append(table[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE)
        cu.append(len(tokens))
    real = len(tokens)
    tokens += [0] * pad_tokens
    positions += [0] * pad_tokens
    slots += [-1] * pad_tokens
    cu += [real] * pad_seqs
    kv_lens = [start + len(chunk) for chunk, start in zip(chunks, before, strict=True)]
    page_indices = np.zeros((len(chunks) + pad_seqs, PAGES_PER_SEQ), np.int32)
    for s, table in enumerate(tables):
        page_indices[s, :len(table)] = table
    batch = PagedBatch(jnp.asarray(slots, jnp.int32),  # [T]
                       jnp.asarray(kv_lens + [0] * pad_seqs, jnp.int32),  # [Q]
                       jnp.asarray(page_indices),  # [Q, pages_per_seq]
                       jnp.asarray(cu, jnp.int32),  # [Q + 1]
                       jnp.asarray([len(chunks)], jnp.int32))  # [1]
    return (jnp.asarray([tokens], jnp.int32), jnp.asarray([positions], jnp.int32),  # [1, T]
            batch)


def _steps(vocab_size):
    """A prefill step of three chunks, then a step mixing a decode with two chunks."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab_size, size=n).tolist() for n in (9, 5, 11)]
    tables = [[5, 2, 9], [7, 1], [3, 8, 4, 6]]  # shuffled physical pages; page 0 unused
    first = _batch([prompts[0][:6], prompts[1][:5], prompts[2][:4]], tables, [0, 0, 0])
    second = _batch([prompts[0][6:], prompts[1][5:] + [11], prompts[2][4:]], tables, [6, 5, 4])
    return [first, second]


@nnx.jit
def _forward(model, tokens, positions, cache):
    return model(tokens, positions, cache)  # [1, T, V], the updated cache


def _run(model, config, cache_dtype, steps, sharding=None):
    """Runs the steps over a fresh pool; returns every step's logits and the final pool."""
    empty = PagedBatch(*(jnp.zeros((1,), jnp.int32) for _ in range(5)))
    cache = PagedKVCache.create(config, 10, PAGE_SIZE, empty, dtype=cache_dtype)
    if sharding is not None:
        pool, scale = sharding
        cache = cache._replace(pages=jax.device_put(cache.pages, pool),
                               scales=None if cache.scales is None
                               else jax.device_put(cache.scales, scale))
    logits = []
    for tokens, positions, batch in steps:
        step_logits, cache = _forward(model, tokens, positions, cache._replace(batch=batch))
        logits.append(np.asarray(step_logits))
    return logits, cache


@pytest.mark.parametrize("cache_dtype, sliding_window", [(None, None), ("int8", None),
                                                         (None, 3)],
                         ids=["float", "int8", "sliding-window"])
def test_the_scan_equals_the_layer_loop(cache_dtype, sliding_window):
    # tiny: 4 query heads over 2 KV heads (GQA); 4 layers so the scan runs a few iterations.
    config = get_preset("tiny").replace(num_layers=4, sliding_window=sliding_window)
    model = create_model(config, seed=0)
    stacked = stack_layers(model)
    assert stacked is not None and len(stacked.layers) == 0
    assert jax.tree.leaves(nnx.state(stacked.stacked_layers))[0].shape[0] == 4
    steps = _steps(config.vocab_size)
    expected_logits, expected_cache = _run(model, config, cache_dtype, steps)
    got_logits, got_cache = _run(stacked, config, cache_dtype, steps)
    for got, expected in zip(got_logits, expected_logits, strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)
    assert got_cache.pages.shape == (4, 10, PAGE_SIZE, 2 * config.num_kv_heads, config.head_dim)
    np.testing.assert_allclose(np.asarray(got_cache.pages, np.float32),
                               np.asarray(expected_cache.pages, np.float32), rtol=0, atol=1e-5)
    if cache_dtype == "int8":
        np.testing.assert_allclose(np.asarray(got_cache.scales),
                                   np.asarray(expected_cache.scales), rtol=1e-6, atol=0)


def test_the_scan_without_a_cache_equals_the_loop_and_refuses_a_contiguous_cache():
    config = get_preset("tiny").replace(num_layers=3)
    model = create_model(config, seed=1)
    stacked = stack_layers(model)
    tokens = jnp.asarray([[5, 9, 13, 2, 7]], jnp.int32)  # [1, T]
    expected, _ = model(tokens)
    got, _ = stacked(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="stacked layers"):
        stacked(tokens, cache=KVCache.create(config, 1, 8))


def test_blocks_that_differ_or_carry_hooks_are_not_stacked():
    config = get_preset("tiny").replace(num_layers=3)
    model = create_model(config, seed=0)
    assert uniform_block_graphdef(list(model.layers)) is not None
    hooked = with_activation_hooks(model, ActivationHooks(keys_values=lambda x: x))
    assert stack_layers(hooked) is None
    mixed = nnx.clone(model)
    mixed.layers[1].attention.sliding_window = 4  # a per-layer window: another graph
    assert stack_layers(mixed) is None
    # The model stacked from is unchanged: its blocks are still its own.
    assert len(model.layers) == 3 and model.stacked_layers is None


def test_the_scan_equals_the_loop_under_tensor_parallelism():
    # 8 query heads over 4 KV heads, split over 2 simulated devices: 2 KV heads each.
    config = get_preset("tiny").replace(num_layers=3, num_heads=8, num_kv_heads=4)
    mesh = make_mesh({"model": 2}, devices=jax.devices()[:2])
    model = create_model(config, seed=2, mesh=mesh)
    with activate(mesh, "tensor_parallel"):
        stacked = stack_layers(model)
    sharding = (NamedSharding(mesh, PartitionSpec(None, None, None, "model", None)),
                NamedSharding(mesh, PartitionSpec(None, None, None, "model")))
    steps = _steps(config.vocab_size)
    for cache_dtype in (None, "int8"):
        with activate(mesh, "tensor_parallel"):
            expected_logits, expected_cache = _run(model, config, cache_dtype, steps, sharding)
            got_logits, got_cache = _run(stacked, config, cache_dtype, steps, sharding)
        for got, expected in zip(got_logits, expected_logits, strict=True):
            np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)
        assert got_cache.pages.sharding.is_equivalent_to(sharding[0], 5)  # split on 2K
        np.testing.assert_allclose(np.asarray(got_cache.pages, np.float32),
                                   np.asarray(expected_cache.pages, np.float32), rtol=0,
                                   atol=1e-5)
