"""The engine serving a HARP model (top blocks without q/k projections or KV cache): greedy
tokens equal reference generation with a float and an int8 page pool, on a scanned runner
whose pool holds only the blocks below the HARP ones (nothing compiled after warm-up), with
int8 weights, under tensor parallelism, and as the target of speculative decoding (prompt
lookup and a draft model)."""

from __future__ import annotations

import random

import pytest
from jax.sharding import PartitionSpec

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.factory import build_engine
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
from jaxinfer.models import create_model
from jaxinfer.models.hooks import ActivationHooks, with_activation_hooks
from jaxinfer.prune.harp import to_harp
from jaxinfer.quant import QuantizationConfig, int8_round_trip, quantize_model
from jaxinfer.sharding import describe

NEW_TOKENS = 6
# 4 blocks, the top two HARP: one skipping its attention (alpha 0), one scaled (0.6). 16
# query heads over 8 KV heads, so tensor parallelism splits whole KV groups.
DENSE = get_preset("tiny").replace(num_layers=4, hidden_size=128, intermediate_size=256,
                                   num_heads=16, num_kv_heads=8)
ALPHAS = (0.0, 0.6)


@pytest.fixture(scope="module")
def dense():
    return create_model(DENSE, seed=4)


@pytest.fixture(scope="module")
def model(dense):
    return to_harp(dense, ALPHAS)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    passages = [[rng.randrange(3, 512) for _ in range(length)] for length in (1, 5, 23, 60)]
    return passages + [passage * 2 for passage in passages[1:]]  # copies: n-grams to find


def _options(**extra) -> dict:
    return dict(page_size=8, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=160,
                enable_prompt_logprobs=False, bucket_growth=4, **extra)


def _run(engine, prompts, speculative: bool = False) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        if speculative:
            engine.add_request(str(index), prompt, params, speculative=True)
        else:
            engine.add_request(str(index), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    assert engine.num_free_pages == engine.config.num_pages - 1  # nothing leaked
    return [outputs[str(index)] for index in range(len(prompts))]


def test_scanned_engine_equals_reference_and_pool_holds_the_cached_layers(model, prompts):
    expected = generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    engine = Engine(model, EngineConfig.from_options(**_options()))
    runner = engine.runner
    assert runner.pages.shape[0] == 2  # [L - n, P, Z, 2K, H]
    state = runner.state
    assert state["stacked_layers"]["attention"]["q_proj"].get_value().shape[0] == 2
    assert sorted(state["layers"]) == [0, 1]  # the two HARP blocks, run after the scan
    assert "q_proj" not in state["layers"][0]["attention"]
    engine.warm_up()
    compiled = runner.compilations
    assert _run(engine, prompts) == expected
    assert runner.compilations == compiled  # warm-up compiled every program the steps use


def test_int8_pool_equals_reference_with_int8_rounding(model, prompts):
    rounded = with_activation_hooks(model, ActivationHooks(keys_values=int8_round_trip))
    expected = generate(rounded, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    engine = Engine(model, EngineConfig.from_options(**_options(kv_cache_dtype="int8")))
    assert engine.runner.pages.shape[0] == 2 and engine.runner.scales.shape[0] == 2
    assert _run(engine, prompts) == expected


def test_int8_weights_quantize_the_harp_blocks_value_and_output(model, prompts):
    quantized = quantize_model(model, QuantizationConfig.for_method("rtn", bits=8))
    harp_attention = quantized.layers[3].attention
    assert not hasattr(harp_attention, "q_proj")
    assert type(harp_attention.v_proj).__name__ == "QuantizedLinear"
    assert type(harp_attention.o_proj).__name__ == "QuantizedLinear"
    expected = generate(quantized, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert _run(Engine(quantized, EngineConfig.from_options(**_options())), prompts) == expected


@pytest.mark.slow  # 24 s
def test_tensor_parallel_equals_one_device(model, prompts):
    expected = _run(Engine(model, EngineConfig.from_options(**_options())), prompts)
    engine = build_engine(model, EngineConfig.from_options(**_options(tensor_parallel_size=4)))
    specs = describe(engine.runner.state)
    assert specs["layers.1.attention.v_proj"] == PartitionSpec(None, "model", None)
    assert specs["layers.1.attention.o_proj"] == PartitionSpec("model", None, None)
    assert engine.runner.pages.sharding.spec == PartitionSpec(None, None, None, "model", None)
    assert _run(engine, prompts) == expected


# 28 s and 52 s on the shared 2-core machine.
@pytest.mark.slow
@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "num_tokens": 3, "max_ngram": 3, "adaptive": False},
    {"method": "draft_model", "model": "dense-drafter", "num_tokens": 3, "adaptive": False},
], ids=["ngram", "draft-model"])
def test_speculative_decoding_with_a_harp_target_equals_reference(model, dense, prompts,
                                                                  speculative):
    expected = generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    drafter = dense if speculative["method"] == "draft_model" else None
    engine = Engine(model, EngineConfig.from_options(**_options(speculative=speculative)),
                    draft_model=drafter)
    assert _run(engine, prompts, speculative=True) == expected
    assert engine.stats().num_draft_tokens > 0
