"""A tiny model with 2:4 sparse weights, quantized into the compressed sparse formats by
round to nearest, saves, restores and serves through `LLM` with the greedy tokens of the
dense model it stands for; a model that is not 2:4 is refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import get_preset
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
from jaxinfer.llm import LLM
from jaxinfer.model_loading import load_model
from jaxinfer.models import create_model
from jaxinfer.quant import (
    QuantizationConfig,
    QuantizationRule,
    QuantizedLinear,
    WeightScheme,
    dequantize_model,
    linear_sites,
    linear_weight_bytes,
    quantize_model,
    restore_quantized_model,
    save_quantized_model,
)
from jaxinfer.sharding import activate, make_mesh
from pallas_kernels import dispatch
from pallas_kernels.quant_matmul import sparse24

FLOAT = QuantizationConfig(method="rtn", rules=(
    QuantizationRule(r"lm_head$", None),
    QuantizationRule(r".", WeightScheme(format="sparse24", bits=32)),
))
# The three value kinds side by side: int4 in the MLP, int8 on o_proj, bf16 elsewhere.
MIXED = QuantizationConfig(method="rtn", rules=(
    QuantizationRule(r"lm_head$", None),
    QuantizationRule(r"\.mlp\.", WeightScheme(format="sparse24_int4", group_size=32)),
    QuantizationRule(r"\.o_proj$", WeightScheme(format="sparse24_int8")),
    QuantizationRule(r".", WeightScheme(format="sparse24")),
))

# Under tensor parallelism: the compressed layout keeps the two halves of I side by side,
# so only output-split layers (q, k, v, gate, up) can be sparse; o and down stay int8.
OUTPUT_SPLIT = QuantizationConfig(method="rtn", rules=(
    QuantizationRule(r"lm_head$", None),
    QuantizationRule(r"\.(o_proj|down_proj)$", WeightScheme(format="int8")),
    QuantizationRule(r".", WeightScheme(format="sparse24_int4", group_size=32)),
))


def _pruned_tiny_model():
    """The tiny preset with every block projection pruned to 2:4 (the LM head stays dense)."""
    model = create_model(get_preset("tiny"), seed=0)
    for site in linear_sites(model):
        if site.path != "lm_head":
            site.set_float_matrix(sparse24.prune_2_4(site.float_matrix()))
    return model


@pytest.fixture(scope="module")
def pruned():
    return _pruned_tiny_model()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 512, size=length).tolist() for length in (3, 11, 30)]


def _served_tokens(directory) -> list[list[int]]:
    llm = LLM(directory, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              bucket_growth=4)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in _prompts()],
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs]


def test_a_scheme_defaults_to_the_formats_bit_width():
    assert WeightScheme(format="sparse24").bits == 16
    assert WeightScheme(format="sparse24_int4", group_size=32).bits == 4
    assert WeightScheme(format="int8").bits == 8


def test_float_sparse_model_serves_the_dense_models_greedy_tokens(pruned, tmp_path):
    quantized = quantize_model(pruned, FLOAT)
    layer = quantized.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.format == "sparse24"
    assert layer.scales is None and layer.positions[...].shape == (128 // 8, 64)
    # f32 values: half the values and 4 bits per group of 4, 0.5 + 1/32 of dense f32.
    stored, bf16 = linear_weight_bytes(quantized, r"^layers\.")
    assert stored == bf16 * 2 * (0.5 + 1 / 32)
    expected = generate(pruned, _prompts(), max_new_tokens=5, eos_token_ids=())
    directory = save_quantized_model(quantized, FLOAT, tmp_path / "sparse24")
    assert _served_tokens(directory) == expected


def test_mixed_sparse_model_saves_restores_and_serves(pruned, tmp_path):
    quantized = quantize_model(pruned, MIXED)
    formats = {site.path: site.layer.format for site in linear_sites(quantized)
               if site.is_quantized}
    assert formats["layers.1.mlp.up_proj"] == "sparse24_int4"
    assert formats["layers.1.attention.o_proj"] == "sparse24_int8"
    assert formats["layers.0.attention.k_proj"] == "sparse24" and "lm_head" not in formats
    # The layers stand for 2:4 matrices.
    for site in linear_sites(quantized):
        if site.is_quantized:
            matrix = np.asarray(site.layer.dequantized())  # [I, O]
            per_group = np.count_nonzero(matrix.reshape(-1, 4, matrix.shape[1]), axis=1)
            assert per_group.max() <= 2, site.path

    directory = save_quantized_model(quantized, MIXED, tmp_path / "mixed")
    restored = restore_quantized_model(directory)
    assert restored.layers[0].mlp.gate_proj.format == "sparse24_int4"
    for left, right in zip(jax.tree.leaves(nnx.state(quantized)),
                           jax.tree.leaves(nnx.state(restored)), strict=True):
        assert left.dtype == right.dtype
        np.testing.assert_array_equal(np.asarray(left), np.asarray(right))

    expected = generate(dequantize_model(quantized), _prompts(), max_new_tokens=5,
                        eos_token_ids=())
    assert _served_tokens(directory) == expected


def test_the_kernel_runs_the_models_forward(pruned):
    quantized = quantize_model(pruned, MIXED)
    tokens = jax.random.randint(jax.random.key(0), (1, 8), 0, 512)  # [B, T]
    reference, _ = quantized(tokens)  # [B, T, V] through the XLA path
    with dispatch.force_implementation("interpret"):
        interpreted, _ = quantized(tokens)  # [B, T, V] through the Pallas kernel
    np.testing.assert_allclose(np.asarray(interpreted), np.asarray(reference),
                               atol=1e-4 * float(np.max(np.abs(np.asarray(reference)))))


def test_a_model_that_is_not_2_4_is_refused():
    dense = create_model(get_preset("tiny"), seed=0)
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.q_proj: weight is not 2:4"):
        quantize_model(dense, FLOAT)


@pytest.mark.slow  # about 30 s: a TP=2 engine
def test_output_split_sparse_layers_serve_under_tensor_parallelism(pruned, tmp_path):
    quantized = quantize_model(pruned, OUTPUT_SPLIT)
    directory = save_quantized_model(quantized, OUTPUT_SPLIT, tmp_path / "tp")
    mesh = make_mesh({"model": 2}, devices=jax.devices()[:2])
    q_proj = load_model(directory, mesh=mesh).layers[0].attention.q_proj
    assert q_proj.positions[...].addressable_shards[0].data.shape == (8, 32)  # [I / 8, O / 2]
    assert q_proj.values[...].addressable_shards[0].data.shape == (16, 32)  # [I / 4, O / 2]
    expected = generate(quantized, _prompts(), max_new_tokens=5, eos_token_ids=())
    llm = LLM(directory, tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, bucket_growth=4)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in _prompts()],
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [output.outputs[0].token_ids for output in outputs] == expected


def test_an_input_split_sparse_layer_is_refused(pruned, tmp_path):
    directory = save_quantized_model(quantize_model(pruned, MIXED), MIXED, tmp_path / "mixed")
    mesh = make_mesh({"model": 2}, devices=jax.devices()[:2])
    loaded = load_model(directory, mesh=mesh)
    tokens = jax.random.randint(jax.random.key(0), (1, 8), 0, 512)  # [B, T]
    with activate(mesh), pytest.raises(ValueError, match="cannot be split on its inputs"):
        loaded(tokens)
