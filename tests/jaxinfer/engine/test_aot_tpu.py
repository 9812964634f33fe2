"""The engine's serving step, at real layer sizes, compiles for TPU slices on this CPU machine
(`make tpu-check`, in the `jax[tpu]` environment), with the collectives tensor and expert
parallelism should have and nothing more, and the TPU compiler refuses a KV pool the chip
cannot hold.

Programs of 1 and 2 layers, unrolled: the layers are identical, so the difference is one
layer's collectives (the engine's step scans over its layers and holds one layer's, which is
checked too); the full-depth compiles are in `benchmarks/tpu_aot.py`.

Skipped where libtpu is not installed (the main environment)."""

from __future__ import annotations

import pytest

from jaxinfer.engine import aot
from jaxinfer.memory_plan import linear_shapes
from pallas_kernels.aot import tpu_compiler_available

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(not tpu_compiler_available(),
                       reason="no TPU compiler here (libtpu): run `make tpu-check`"),
]

OPTIONS = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=2048, num_pages=512,
               enable_prompt_logprobs=False)
NONE = dict.fromkeys(aot.COLLECTIVES, 0)


def _per_layer(case: aot.ServingCase, num_tokens: int = 16, num_seqs: int = 16
               ) -> tuple[dict[str, int], dict[str, int]]:
    """(collectives per layer, collectives once per step) of one bucket's step, from the
    programs unrolled at 1 and 2 layers; the engine's scanned step holds one layer's."""
    counts = [aot.compile_step(aot.abstract_runner(case.replace(num_layers=layers),
                                                   scan_layers=False),
                               num_tokens, num_seqs).collectives for layers in (1, 2)]
    per_layer = {op: counts[1][op] - counts[0][op] for op in aot.COLLECTIVES}
    once = {op: counts[0][op] - per_layer[op] for op in aot.COLLECTIVES}
    scanned = aot.compile_step(aot.abstract_runner(case.replace(num_layers=2)), num_tokens,
                               num_seqs).collectives
    assert scanned == counts[0]
    return per_layer, once


def test_llama_3_8b_on_v5e_8_has_two_all_reduces_per_layer():
    case = aot.ServingCase(name="llama-3-8b", preset="llama-3-8b", topology="v5e:2x4",
                           tensor_parallel=8, options=OPTIONS)
    per_layer, once = _per_layer(case)
    # Attention's output projection and the MLP's down projection each end in one; the
    # step adds the vocabulary-split embedding's all-reduce and the logits' all-gather.
    assert per_layer == dict(NONE, **{"all-reduce": 2})
    assert once == dict(NONE, **{"all-reduce": 1, "all-gather": 1})


def test_int8_weights_and_kv_split_without_gathering_on_v5e_4():
    """Quantized layers run per shard: a layer has the float model's two all-reduces and no
    all-gather (a Pallas matmul the compiler cannot split would gather its weight)."""
    case = aot.ServingCase(name="llama-3-8b int8", preset="llama-3-8b", topology="v5e:2x2",
                           tensor_parallel=4, weights="int8", kv_cache_dtype="int8",
                           options=OPTIONS)
    per_layer, _ = _per_layer(case)
    assert per_layer == dict(NONE, **{"all-reduce": 2})
    runner = aot.abstract_runner(case.replace(num_layers=1))
    report = aot.compile_step(runner, 64, 16)
    # Per chip: a quarter of the int8 layer (values and per-channel scales), the bf16
    # embedding and LM head split four ways.
    config = case.model_config
    layer = sum(k * n + 4 * n for k, n in linear_shapes(config.replace(num_layers=1)))
    embeddings = 2 * 2 * config.vocab_size * config.hidden_size
    assert report.weight_bytes == pytest.approx((layer + embeddings) / 4, rel=5e-3)


def test_mixtral_expert_parallel_on_v5p_8():
    case = aot.ServingCase(name="mixtral", preset="mixtral-8x7b", topology="v5p:2x2x1",
                           tensor_parallel=2, expert_parallel=2, options=OPTIONS)
    per_layer, _ = _per_layer(case)
    # Attention's output projection over 'model', and one all-reduce adding the experts'
    # results over 'expert' and 'model' (jaxinfer.models.moe); nothing is gathered per layer.
    assert per_layer == dict(NONE, **{"all-reduce": 2})


def test_the_compiler_refuses_a_pool_the_chip_cannot_hold():
    """One layer of Llama-3-8B on one v5e chip: 64 KiB per page, so 300,000 pages is 18 GiB
    of a 16 GiB chip."""
    case = aot.ServingCase(name="overfull", preset="llama-3-8b", topology="v5e:2x2",
                           tensor_parallel=1, num_layers=1,
                           options=dict(OPTIONS, num_pages=300_000))
    with pytest.raises(Exception, match=r"RESOURCE_EXHAUSTED.*HBM"):
        aot.compile_step(aot.abstract_runner(case), 16, 16)
