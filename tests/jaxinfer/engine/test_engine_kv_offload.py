"""The engine with the host KV tier: greedy outputs equal the engine's without it, on a
multi-turn workload whose device pool is too small to keep the shared prefixes (so they are
evicted to host memory and found there later) and on one that forces preemption with swap;
no page leaks on either tier after aborts and preemptions; the counters add up; no
compilation after warm-up."""

from __future__ import annotations

import random

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.factory import build_engine
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.models import create_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
OPTIONS = dict(page_size=8, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256,
               enable_prompt_logprobs=False, bucket_growth=4)


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


def _conversations(engine, turns=3, count=6, seed=0):
    """`count` conversations sharing a 64-token system prompt, each turn its history plus its
    answer plus 10 new tokens; one conversation's turns wait for the previous ones. Returns
    every turn's tokens in order."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(64)]
    histories = [system + [rng.randrange(3, 500) for _ in range(20)] for _ in range(count)]
    outputs = []
    for turn in range(turns):
        for index, history in enumerate(histories):
            engine.add_request(f"{turn}-{index}", history, PARAMS)
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = list(output.outputs[0].token_ids)
        for index in range(count):
            answer = done[f"{turn}-{index}"]
            outputs.append(answer)
            histories[index] = (histories[index] + answer
                                + [rng.randrange(3, 500) for _ in range(10)])
    return outputs


def _assert_back_to_full(engine):
    engine.kv_offload.collect()
    stats = engine.stats()
    assert engine.num_free_pages == engine.config.num_pages - 1
    host = engine.kv_offload.host_pool
    assert host.num_pending_blocks == 0 and host.num_pinned_blocks == 0
    assert stats.num_free_host_blocks == stats.num_host_blocks == host.num_blocks


def test_evicted_prefixes_load_from_host_with_equal_outputs(model):
    plain = Engine(model, EngineConfig.from_options(num_pages=40, **OPTIONS))
    expected = _conversations(plain)
    tiered = Engine(model, EngineConfig.from_options(num_pages=40, kv_offload_bytes=1 << 22,
                                                     **OPTIONS))
    tiered.warm_up()
    compiled = tiered.compilations
    assert _conversations(tiered) == expected
    assert tiered.compilations == compiled
    stats, plain_stats = tiered.stats(), plain.stats()
    # Lookups repeat while the queue's head waits for pages; admitted hits are loaded once.
    assert stats.host_cache_hits >= stats.host_cache_hit_tokens // 8 > 0
    assert stats.kv_bytes_to_host > 0
    block_bytes = tiered.kv_offload.host_pool.block_bytes
    assert stats.kv_bytes_to_device == stats.host_cache_hit_tokens // 8 * block_bytes
    assert stats.kv_copy_seconds > 0.0 and 0.0 < stats.host_cache_token_hit_rate < 1.0
    # The loaded tokens were not computed again.
    assert stats.iteration_tokens_sum == plain_stats.iteration_tokens_sum - (
        stats.host_cache_hit_tokens)
    _assert_back_to_full(tiered)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_host_tier_keeps_outputs_and_frees_everything(model, mode):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(40, 90))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = dict(OPTIONS, num_pages=33, max_model_len=128)

    def run(engine, abort=()):
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, params)
        outputs, step = {}, 0
        while engine.has_unfinished_requests():
            if step == 6:
                for request_id in abort:
                    engine.abort_request(request_id)
            for output in engine.step():
                outputs[output.request_id] = list(output.outputs[0].token_ids)
            step += 1
        return outputs

    expected = run(Engine(model, EngineConfig.from_options(**options)))
    engine = Engine(model, EngineConfig.from_options(kv_offload_bytes=1 << 22,
                                                     preemption_mode=mode, **options))
    assert run(engine) == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_blocks > 0 and stats.host_cache_hits > 0
    _assert_back_to_full(engine)
    # Aborts in the middle (of running and of preempted requests) leak nothing either.
    aborted = run(engine, abort=["1", "4", "6"])
    for request_id in ("0", "2", "3", "5", "7"):
        assert aborted[request_id] == expected[request_id]
    _assert_back_to_full(engine)


@pytest.mark.slow
def test_tensor_parallel_int8_host_tier_equals_one_device_plain():
    wide = get_preset("tiny").replace(hidden_size=128, intermediate_size=256, num_heads=16,
                                      num_kv_heads=4)
    model = create_model(wide, seed=2)
    plain = Engine(model, EngineConfig.from_options(num_pages=40, kv_cache_dtype="int8",
                                                    **OPTIONS))
    expected = _conversations(plain)
    engine = build_engine(model, EngineConfig.from_options(
        num_pages=40, kv_cache_dtype="int8", kv_offload_bytes=1 << 22,
        tensor_parallel_size=2, **OPTIONS))
    assert _conversations(engine) == expected
    assert engine.stats().host_cache_hits > 0
    _assert_back_to_full(engine)


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_host_tier_with_a_harp_model_and_an_fp8_pool_keeps_outputs(kv_cache_dtype):
    # A HARP model's pool holds only its cached layers; the tier copies whatever the pool
    # holds (fp8 pages and their scales too), so the same workload gives the same tokens.
    harp = create_model(get_preset("tiny").replace(num_layers=3, harp_alphas=(0.5,)), seed=1)
    options = dict(OPTIONS, num_pages=40, kv_cache_dtype=kv_cache_dtype)
    expected = _conversations(Engine(harp, EngineConfig.from_options(**options)))
    tiered = Engine(harp, EngineConfig.from_options(kv_offload_bytes=1 << 22, **options))
    assert tiered.runner.pages.shape[0] == 2
    assert _conversations(tiered) == expected
    assert tiered.stats().host_cache_hit_tokens > 0
    _assert_back_to_full(tiered)
