"""KVOffloader: pages (and int8 scales) copied to the host tier and back are bit-identical, per
shard under tensor parallelism; the copy programs compile once per bucket; config checks."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.config import CacheConfig, EngineConfig, SchedulerConfigError
from jaxinfer.engine.core import Engine
from jaxinfer.engine.device.kv_offload import KVOffloader
from jaxinfer.engine.device.runner import ModelRunner, RunnerConfig
from jaxinfer.engine.factory import build_engine
from jaxinfer.engine.host.host_block_pool import KVTransfers
from jaxinfer.models import create_model

NUM_PAGES = 16
# 16 query heads over 4 KV heads, so TP = 2 gives each device two whole KV heads.
WIDE = get_preset("tiny").replace(hidden_size=128, intermediate_size=256, num_heads=16,
                                  num_kv_heads=4)


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


def _runner(model, **overrides):
    config = dict(num_pages=NUM_PAGES, page_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                  max_model_len=32)
    return ModelRunner(model, RunnerConfig(**{**config, **overrides}))


def _fill_randomly(runner, seed):
    """Puts random values in every pool array (keeping each one's sharding); returns them as
    host arrays in `jax.tree.leaves` order."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten((runner.pages, runner.scales))
    values = []
    for leaf in leaves:
        if np.issubdtype(leaf.dtype, np.integer):
            value = rng.integers(-128, 128, leaf.shape).astype(leaf.dtype)
        else:
            value = rng.standard_normal(leaf.shape).astype(leaf.dtype)
        values.append(value)
    placed = [jax.device_put(value, leaf.sharding) for value, leaf in zip(values, leaves)]
    runner.pages, runner.scales = jax.tree.unflatten(treedef, placed)
    return values


def _round_trip(offloader, sources, targets):
    """Offloads `sources`, collects, loads them into `targets`; checks the host bytes and the
    restored pages bit for bit, and that no other page but the null one changed."""
    runner, host = offloader.runner, offloader.host_pool
    before = _fill_randomly(runner, seed=len(sources))
    slots = [host.reserve(f"hash{block}".encode()) for block in sources]
    offloader.issue(KVTransfers(offloads=list(zip(sources, slots))))
    # The step after the offload may overwrite the evicted pages: the copy must not see it.
    _fill_randomly(runner, seed=99)
    overwritten = [np.asarray(leaf) for leaf in jax.tree.leaves((runner.pages, runner.scales))]
    assert offloader.collect() == len(sources)
    # Host buffers: per pool array, its shards side by side along the split axis.
    buffer = 0
    for value in before:
        parts = len(host.buffers) // len(before)
        stored = np.concatenate([host.buffers[buffer + part][slots] for part in range(parts)],
                                axis=-1 if value.ndim == 4 else -2)
        buffer += parts
        expected = np.moveaxis(value[:, sources], 1, 0)  # [n, L, ...]
        assert stored.tobytes() == expected.tobytes()
    assert host.lookup(b"hash%d" % sources[0]) == slots[0]
    offloader.issue(KVTransfers(loads=list(zip(slots, targets))))
    after = [np.asarray(leaf) for leaf in jax.tree.leaves((runner.pages, runner.scales))]
    for value, now, old in zip(before, after, overwritten):
        assert now[:, targets].tobytes() == value[:, sources].tobytes()
        untouched = [page for page in range(1, NUM_PAGES) if page not in targets]
        assert now[:, untouched].tobytes() == old[:, untouched].tobytes()
    assert offloader.bytes_to_host == offloader.bytes_to_device == len(sources) * host.block_bytes


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_blocks_restored_from_host_are_bit_identical(model, cache_dtype):
    runner = _runner(model, cache_dtype=cache_dtype)
    offloader = KVOffloader(runner, 1 << 20)
    leaves = jax.tree.leaves((runner.pages, runner.scales))
    assert len(leaves) == (2 if cache_dtype == "int8" else 1)  # the scales travel too
    assert offloader.host_pool.block_bytes == sum(leaf.nbytes // NUM_PAGES for leaf in leaves)
    _round_trip(offloader, sources=[3, 5, 7], targets=[10, 11, 12])


def test_tensor_parallel_shards_offload_their_own_heads():
    model = create_model(WIDE, seed=1)
    engine = build_engine(model, EngineConfig.from_options(
        page_size=4, num_pages=NUM_PAGES, max_num_batched_tokens=16, max_num_seqs=4,
        max_model_len=32, tensor_parallel_size=2, kv_offload_bytes=1 << 20,
        kv_cache_dtype="int8", enable_prompt_logprobs=False))
    offloader = engine.kv_offload
    pages = engine.runner.pages  # [L, P, Z, 2K, H]
    assert len(pages.sharding.device_set) == 2
    # One host buffer per device shard of the pages and of the scales, each with its half of
    # the interleaved key/value heads.
    shapes = [buffer.shape[1:] for buffer in offloader.host_pool.buffers]
    half = 2 * WIDE.num_kv_heads // 2
    assert shapes == [(WIDE.num_layers, 4, half, WIDE.head_dim)] * 2 + [
        (WIDE.num_layers, 4, half)] * 2
    _round_trip(offloader, sources=[2, 9], targets=[4, 14])


def test_copy_programs_compile_once_per_bucket(model):
    runner = _runner(model)
    offloader = KVOffloader(runner, 1 << 20)
    offloader.warm_up()
    compiled = offloader.compilations
    assert compiled == 2 * len(offloader.buckets)
    host = offloader.host_pool
    for count in (1, 3, 5):
        slots = [host.reserve(f"{count}-{block}".encode()) for block in range(1, count + 1)]
        offloader.issue(KVTransfers(offloads=list(zip(range(1, count + 1), slots))))
        offloader.collect()
        offloader.issue(KVTransfers(loads=list(zip(slots, range(8, 8 + count)))))
    assert offloader.compilations == compiled
    assert offloader.num_ready + offloader.num_waited == 3
    # More blocks than the largest bucket go in several batches.
    blocks = list(range(1, NUM_PAGES)) + [1, 2, 3, 4, 5]
    slots = [host.reserve(f"many-{index}".encode()) for index in range(len(blocks))]
    offloader.issue(KVTransfers(offloads=list(zip(blocks, slots))))
    offloader.collect()
    pages = np.asarray(runner.pages)  # [L, P, Z, 2K, H]
    assert host.buffers[0][slots].tobytes() == np.moveaxis(pages[:, blocks], 1, 0).tobytes()
    assert offloader.compilations == compiled
    assert offloader.copy_seconds >= offloader.seconds["blocked"] >= 0.0


def test_too_small_offload_size_names_the_field(model):
    with pytest.raises(ValueError, match="kv_offload_bytes = 10 holds no KV block"):
        KVOffloader(_runner(model), 10)


@pytest.mark.parametrize(("options", "field"), [
    (dict(kv_offload_bytes=-1), "kv_offload_bytes"),
    (dict(kv_offload_bytes=1.5), "kv_offload_bytes"),
    (dict(kv_offload_bytes=1 << 20, enable_prefix_caching=False), "kv_offload_bytes"),
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(preemption_mode="swap"), "preemption_mode"),  # without the host tier
])
def test_config_validation_names_the_field(options, field):
    with pytest.raises(SchedulerConfigError, match=f"'{field}'"):
        CacheConfig(**options)


def test_options_round_trip_and_flags(tmp_path):
    config = EngineConfig.from_options(kv_offload_bytes=1 << 30, preemption_mode="swap")
    assert config.cache.kv_offload_bytes == 1 << 30 and config.cache.preemption_mode == "swap"
    assert EngineConfig.from_options(**config.options()) == config
    path = tmp_path / "engine.toml"
    path.write_text('kv-offload-bytes = 4096\npreemption_mode = "swap"\n')
    assert EngineConfig.from_file(path).cache.kv_offload_bytes == 4096
    import argparse

    from jaxinfer.engine.config import add_engine_arguments, engine_options_from_args
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-offload-bytes", "2048", "--preemption-mode", "swap"])
    options = engine_options_from_args(args)
    assert options["kv_offload_bytes"] == 2048 and options["preemption_mode"] == "swap"


def test_engine_without_host_tier_has_no_offloader(model):
    engine = Engine(model, EngineConfig.from_options(page_size=4, max_num_seqs=2,
                                                     max_model_len=32))
    assert engine.kv_offload is None and engine.stats().num_host_blocks == 0
