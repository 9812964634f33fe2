"""The engine with its kernels forced through Pallas (TPU interpret mode) gives the greedy
tokens of the default XLA paths: a short run of the `tiny` preset (attention), of `tiny-moe`
(attention and the MoE grouped matmuls) and of `tiny` with int8 / int4 weights (attention and
the quantized matmuls), decodes, prefills and chunked prefills mixed in the same steps."""

from __future__ import annotations

import random

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.models import create_model
from jaxinfer.quant import QuantizationConfig, quantize_model
from pallas_kernels import dispatch


def _greedy_run(model, prompts):
    # A 24-token budget splits the 40-token prompt into chunks while others decode.
    config = EngineConfig.from_options(page_size=8, max_num_batched_tokens=24, max_num_seqs=4,
                          max_model_len=64, enable_prompt_logprobs=False)
    engine = Engine(model, config)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt,
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    assert engine.num_free_pages == engine.config.num_pages - 1
    return [outputs[str(index)] for index in range(len(prompts))]


# (preset, weight quantization: (bits, group size) or None)
CASES = {"tiny": ("tiny", None), "tiny-moe": ("tiny-moe", None),
         "tiny-int8": ("tiny", (8, None)), "tiny-int4": ("tiny", (4, 32))}


# The default run keeps one case per kernel family (int8 covers the attention kernel too); the
# float and int4 runs repeat the same kernels and are slow-marked to hold the CI budget.
@pytest.mark.parametrize("case", [
    pytest.param("tiny", marks=pytest.mark.slow), "tiny-moe", "tiny-int8",
    pytest.param("tiny-int4", marks=pytest.mark.slow)])
def test_engine_through_the_interpreted_kernels_equals_the_xla_paths(case):
    preset, quantization = CASES[case]
    model = create_model(get_preset(preset), seed=0)
    if quantization is not None:
        bits, group_size = quantization
        model = quantize_model(model, QuantizationConfig.for_method(
            "rtn", bits=bits, group_size=group_size))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(length)] for length in (1, 9, 40, 3)]
    expected = _greedy_run(model, prompts)
    with dispatch.force_implementation("interpret"):
        got = _greedy_run(model, prompts)
    assert got == expected
