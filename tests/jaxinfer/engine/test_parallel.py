"""The engine on a mesh of 8 simulated CPU devices: tensor, data and expert parallel layouts
give the single-device engine's greedy tokens, with weights and KV pages where they belong."""

from __future__ import annotations

import random

import jax
import pytest
from jax.sharding import PartitionSpec

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.data_parallel import DataParallelEngine
from jaxinfer.engine.factory import build_engine, load_engine
from jaxinfer.engine.parallel import ParallelConfig, ParallelConfigError
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.models import create_model
from jaxinfer.sharding import describe

NEW_TOKENS = 6
NUM_REQUESTS = 32

# 16 query heads over 8 KV heads, so TP = 8 still gives each device a whole KV head (and GQA
# groups of 2 stay on one device at every TP size).
WIDE = get_preset("tiny").replace(hidden_size=128, intermediate_size=256, num_heads=16,
                                  num_kv_heads=8)
MOE = get_preset("tiny-moe")


def _engine_options(**parallel) -> dict:
    return dict(page_size=8, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                enable_prompt_logprobs=False, bucket_growth=4, **parallel)


def _workload(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """32 prompts of 1 to 150 tokens, some sharing a prefix, and random arrival steps."""
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab_size) for _ in range(40)]
    prompts = []
    for index in range(NUM_REQUESTS):
        length = rng.choice([1, 3, 17, 48, 90, 150])
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        if index % 4 == 0 and length > 40:
            prompt[:40] = shared
        prompts.append(prompt)
    return prompts, sorted(rng.randrange(0, 12) for _ in prompts)


def _run(engine, prompts, arrivals) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    pending, step = list(range(len(prompts))), 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            index = pending.pop(0)
            engine.add_request(str(index), prompts[index], params)
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
        step += 1
    return [outputs[str(index)] for index in range(len(prompts))]


@pytest.fixture(scope="module")
def wide_model():
    return create_model(WIDE, seed=3)


@pytest.fixture(scope="module")
def wide_reference(wide_model):
    prompts, arrivals = _workload(WIDE.vocab_size)
    engine = Engine(wide_model, EngineConfig.from_options(**_engine_options()))
    return prompts, arrivals, _run(engine, prompts, arrivals)


def _pool_spec(engine: Engine) -> PartitionSpec:
    return engine.runner.pages.sharding.spec


@pytest.mark.parametrize("tensor_parallel_size", [2, 4, 8])
def test_tensor_parallel_equals_one_device(wide_model, wide_reference, tensor_parallel_size):
    prompts, arrivals, expected = wide_reference
    engine = build_engine(wide_model, EngineConfig.from_options(
        **_engine_options(tensor_parallel_size=tensor_parallel_size)))
    assert isinstance(engine, Engine)
    # Weights: heads and MLP width split over 'model' (the runner's blocks are stacked behind
    # a replicated layer axis); the pool split on its KV-head axis.
    specs = describe(engine.runner.state)
    assert specs["stacked_layers.attention.q_proj"] == PartitionSpec(None, None, "model", None)
    assert specs["stacked_layers.attention.k_proj"] == PartitionSpec(None, None, "model", None)
    assert specs["stacked_layers.mlp.down_proj"] == PartitionSpec(None, "model", None)
    assert _pool_spec(engine) == PartitionSpec(None, None, None, "model", None)
    pages = engine.runner.pages  # [L, P, Z, 2K, H]
    shard_shapes = {shard.data.shape for shard in pages.addressable_shards}
    assert shard_shapes == {(WIDE.num_layers, pages.shape[1], pages.shape[2],
                             2 * WIDE.num_kv_heads // tensor_parallel_size, WIDE.head_dim)}
    assert len(pages.sharding.device_set) == tensor_parallel_size
    assert _run(engine, prompts, arrivals) == expected
    assert engine.num_free_pages == engine.config.num_pages - 1


def test_data_parallel_of_tensor_parallel_replicas(wide_model, wide_reference):
    prompts, arrivals, expected = wide_reference
    engine = build_engine(wide_model, EngineConfig.from_options(
        **_engine_options(tensor_parallel_size=4, data_parallel_size=2)))
    assert isinstance(engine, DataParallelEngine)
    first, second = engine.replicas
    # Each replica on its own four devices, its pool split over them.
    devices = [set(replica.runner.pages.sharding.device_set) for replica in engine.replicas]
    assert len(devices[0]) == len(devices[1]) == 4 and not devices[0] & devices[1]
    weights = first.runner.state["stacked_layers"]["attention"]["q_proj"].get_value()
    assert set(weights.sharding.device_set) == devices[0]
    assert _pool_spec(first) == _pool_spec(second) == PartitionSpec(None, None, None, "model",
                                                                    None)
    assert _run(engine, prompts, arrivals) == expected
    # Both replicas took work, and neither leaked a page.
    assert first.num_steps > 0 and second.num_steps > 0
    assert engine.num_free_pages == sum(replica.config.num_pages - 1
                                        for replica in engine.replicas)
    assert engine.stats().num_running == 0
    engine.shutdown()


def test_expert_parallel_mixtral_equals_one_device():
    model = create_model(MOE, seed=5)
    prompts, arrivals = _workload(MOE.vocab_size)
    expected = _run(Engine(model, EngineConfig.from_options(
            **_engine_options())), prompts, arrivals)
    engine = build_engine(model, EngineConfig.from_options(
            **_engine_options(expert_parallel_size=4)))
    specs = describe(engine.runner.state)
    # Experts over 'expert' (the replica's 'model' axis has size 1 here), behind the runner's
    # replicated layer axis.
    assert specs["stacked_layers.mlp.gate_proj"] == PartitionSpec(None, "expert", None, "model")
    assert specs["stacked_layers.mlp.down_proj"] == PartitionSpec(None, "expert", "model", None)
    gate = engine.runner.state["stacked_layers"]["mlp"]["gate_proj"].get_value()  # [L, E, D, F]
    assert {shard.data.shape[1] for shard in gate.addressable_shards} == {1}  # 1 expert each
    assert len(gate.sharding.device_set) == 4
    assert _run(engine, prompts, arrivals) == expected


def test_invalid_layouts_fail_at_start_with_a_message(wide_model):
    tiny = create_model(get_preset("tiny"), seed=0)  # 2 KV heads
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size = 4 does not divide"):
        build_engine(tiny, EngineConfig.from_options(**_engine_options(tensor_parallel_size=4)))
    with pytest.raises(ParallelConfigError, match="16 devices, but only 8"):
        build_engine(wide_model, EngineConfig.from_options(
            **_engine_options(tensor_parallel_size=8, data_parallel_size=2)))
    with pytest.raises(ParallelConfigError, match="no experts"):
        build_engine(tiny, EngineConfig.from_options(**_engine_options(expert_parallel_size=2)))
    with pytest.raises(ParallelConfigError, match="must be an integer >= 1"):
        EngineConfig.from_options(tensor_parallel_size=0)
    with pytest.raises(ParallelConfigError, match="does not divide the model's 4 experts"):
        ParallelConfig(expert_parallel_size=3).check_model(MOE)
    # Checked before any weight is read.
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size = 8"):
        load_engine("random:tiny", tensor_parallel_size=8)
    assert len(jax.devices()) == 8


def test_llm_takes_vllm_parallel_keywords_and_never_compiles_after_warm_up():
    from jaxinfer import LLM

    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    options = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                   enable_prompt_logprobs=False, bucket_growth=4)
    single = LLM("random:tiny", **options).generate(prompts, params)
    expected = [output.outputs[0].token_ids for output in single]
    for parallel in (dict(tensor_parallel_size=2, data_parallel_size=2),
                     dict(data_parallel_size=2)):  # one-device replicas
        sharded = LLM("random:tiny", warm_up=True, **parallel, **options)
        assert isinstance(sharded.engine, DataParallelEngine)
        compiled = sharded.engine.compilations
        outputs = sharded.generate(prompts * 3, params)  # both replicas get work
        assert [output.outputs[0].token_ids for output in outputs] == expected * 3
        # A lone short request runs in the smallest bucket, the one warm-up compiled first
        # (against the freshly allocated pool rather than a step's output pool).
        assert sharded.generate(prompts[0], params)[0].outputs[0].token_ids == expected[0]
        assert sharded.engine.compilations == compiled
        assert all(replica.num_steps for replica in sharded.engine.replicas)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int4"])
def test_tensor_parallel_quantized_kv_equals_one_device(wide_model, kv_cache_dtype):
    # Each shard quantizes and reads its own KV heads: scales, KIVI's key and value scales
    # and its residual seats split on their head axes like the pages.
    prompts, arrivals = _workload(WIDE.vocab_size)
    options = _engine_options(kv_cache_dtype=kv_cache_dtype)
    expected = _run(Engine(wide_model, EngineConfig.from_options(**options)), prompts, arrivals)
    engine = build_engine(wide_model, EngineConfig.from_options(**options,
                                                                tensor_parallel_size=2))
    for leaf in jax.tree.leaves(engine.runner.scales):
        assert len(leaf.sharding.device_set) == 2
        assert {shard.data.shape for shard in leaf.addressable_shards} != {leaf.shape}
    assert _run(engine, prompts, arrivals) == expected
