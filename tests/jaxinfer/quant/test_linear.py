"""Quantized linear layers and whole-model RTN quantization.

The layer must equal dequantize-then-matmul through both the jnp reference and the Pallas
kernel (TPU interpret mode); a quantized model must equal its dequantized float copy; and
the engine must generate exactly what the reference `generate` does with the same
quantized model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
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
)
from jaxinfer.quant.linear import quantize_matrix
from pallas_kernels import dispatch
from pallas_kernels.quant_matmul import cpu as cpu_quant_matmul
from pallas_kernels.quant_matmul import dequantize_weight, quantized_matmul

SCHEMES = {
    "int8": WeightScheme(format="int8"),
    "int4-g32-sym": WeightScheme(format="int4", bits=4, group_size=32),
    "int4-g32-asym": WeightScheme(format="int4", bits=4, group_size=32, symmetric=False),
    "int3-g32-asym": WeightScheme(format="int4", bits=3, group_size=32, symmetric=False),
}


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


def _relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_layer_equals_dequantize_then_matmul(scheme_name, implementation):
    matrix = jax.random.normal(jax.random.key(0), (64, 4 * 16))  # [K, N]
    x = jax.random.normal(jax.random.key(1), (2, 5, 64))  # [B, T, K]
    layer = QuantizedLinear(quantize_matrix(matrix, SCHEMES[scheme_name]), (4, 16),
                            implementation=implementation)
    out = layer(x)  # [B, T, 4, 16]
    assert out.shape == (2, 5, 4, 16) and out.dtype == x.dtype
    expected = jnp.einsum("btk,kn->btn", x, layer.dequantized(),
                          precision=jax.lax.Precision.HIGHEST).reshape(2, 5, 4, 16)
    assert _relative_error(out, expected) < 1e-5
    # And it is a quantization of the float matmul, not some other matrix.
    assert _relative_error(out, (x @ matrix).reshape(2, 5, 4, 16)) < (
        0.02 if scheme_name == "int8" else 0.35)


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_an_input_permuted_layer_equals_the_unpermuted_one(implementation):
    """Rows stored in `perm` order with `input_permutation=perm` multiply like the original
    matrix (act-order GPTQ checkpoints), and `dequantized` puts the rows back."""
    matrix = jax.random.normal(jax.random.key(4), (64, 32))  # [K, N]
    x = jax.random.normal(jax.random.key(5), (3, 64))  # [M, K]
    permutation = jax.random.permutation(jax.random.key(6), 64).astype(jnp.int32)  # [K]
    scheme = SCHEMES["int4-g32-asym"]
    plain = QuantizedLinear(quantize_matrix(matrix, scheme), (32,),
                            implementation=implementation)
    permuted = QuantizedLinear(quantize_matrix(matrix[permutation], scheme), (32,),
                               implementation=implementation, input_permutation=permutation)
    np.testing.assert_array_equal(
        np.asarray(permuted.dequantized()),
        np.asarray(dequantize_weight(permuted.weight))[np.argsort(permutation)])
    expected = x @ permuted.dequantized()  # [M, N]
    assert _relative_error(permuted(x), expected) < 1e-5
    assert _relative_error(permuted(x), plain(x)) < 0.2  # both quantize the same matrix
    assert permuted.nbytes() == plain.nbytes() + 4 * 64
    with pytest.raises(ValueError, match="input_permutation"):
        QuantizedLinear(permuted.weight, (32,), input_permutation=permutation[:32])


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_w8a8_layer_equals_the_w8a8_op_and_approximates_the_matmul(implementation):
    matrix = jax.random.normal(jax.random.key(2), (64, 32))  # [K, N]
    x = jax.random.normal(jax.random.key(3), (7, 64))  # [M, K]
    layer = QuantizedLinear(quantize_matrix(matrix, WeightScheme(format="w8a8")), (32,),
                            implementation=implementation)
    expected = quantized_matmul(x, layer.weight, implementation="reference")  # [M, N]
    np.testing.assert_allclose(layer(x), expected, rtol=1e-6, atol=1e-5)
    assert _relative_error(layer(x), x @ layer.dequantized()) < 0.02


def test_quantize_model_follows_the_rules(model):
    config = QuantizationConfig.for_method("rtn", bits=4, group_size=32, symmetric=False)
    quantized = quantize_model(model, config)
    paths = {site.path: site for site in linear_sites(quantized)}
    assert len(paths) == 2 * 7 + 1  # q k v o gate up down per block, and the LM head
    for path, site in paths.items():
        assert site.is_quantized == (path != "lm_head"), path
    q_proj = paths["layers.0.attention.q_proj"].layer
    assert (q_proj.format, q_proj.bits, q_proj.group_size) == ("int4", 4, 32)
    assert q_proj.output_shape == (4, 16)  # [N, H]
    assert paths["layers.1.attention.o_proj"].layer.values.shape == (32, 64)  # [N*H/2, D]
    # The float model is untouched.
    assert not any(site.is_quantized for site in linear_sites(model))


@pytest.mark.parametrize("scheme_name", [
    pytest.param("int8", marks=pytest.mark.slow),  # the layer tests cover int8 already
    "int4-g32-asym"])
def test_quantized_model_equals_its_dequantized_copy(model, scheme_name):
    config = QuantizationConfig(method="rtn", rules=(QuantizationRule(r".",
                                                                      SCHEMES[scheme_name]),))
    quantized = quantize_model(model, config)  # LM head included
    float_copy = dequantize_model(quantized)
    assert not any(site.is_quantized for site in linear_sites(float_copy))
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, 512)  # [B, T]
    expected, _ = float_copy(tokens)  # [B, T, V]
    actual, _ = quantized(tokens)  # [B, T, V]
    assert _relative_error(actual, expected) < 1e-5
    with dispatch.force_implementation("interpret"):
        interpreted, _ = quantized(tokens)  # [B, T, V] through the Pallas kernels
    assert _relative_error(interpreted, expected) < 1e-5
    original, _ = model(tokens)
    assert _relative_error(actual, original) < (0.02 if scheme_name == "int8" else 0.2)


def test_weight_bytes_count_values_scales_and_zeros(model):
    d, f, heads, kv_heads, head_dim = 64, 128, 4, 2, 16
    per_block = [(d, heads * head_dim), (d, kv_heads * head_dim), (d, kv_heads * head_dim),
                 (heads * head_dim, d), (d, f), (d, f), (f, d)]
    head = 64 * 512 * 4  # the float32 LM head stays
    config = QuantizationConfig.for_method("rtn", bits=4, group_size=32, symmetric=False)
    quantized = quantize_model(model, config)
    stored, bf16 = linear_weight_bytes(quantized)
    # Two values a byte, one float32 scale and one int8 zero per 32 rows per column.
    expected = 2 * sum(k * n // 2 + (k // 32) * n * 5 for k, n in per_block)
    assert stored == expected + head
    assert bf16 == 2 * sum(k * n for k, n in per_block) * 2 + 64 * 512 * 2
    assert linear_weight_bytes(quantized, r"^layers\.") == (
        expected, 2 * sum(k * n for k, n in per_block) * 2)


def test_a_shape_that_does_not_fit_names_the_weight(model):
    config = QuantizationConfig.for_method("rtn", bits=4, group_size=48)
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.q_proj.*group_size"):
        quantize_model(model, config)


def test_engine_greedy_equals_reference_generate_on_the_quantized_model(model, monkeypatch):
    # Float activations in every product: by default the CPU kernel rounds the activations
    # of products of at most 4 rows to int8 (`pallas_kernels.quant_matmul.cpu.DECODE_ROWS`),
    # so a request decoding alone in the engine (max_num_seqs = 4 leaves the fifth one
    # alone at the end) would round where `generate`'s five-row batch does not. This test is
    # about the engine's paging and scheduling over quantized weights.
    monkeypatch.setenv("JAXINFER_CPU_INT8_ACTIVATIONS", "off")
    jax.clear_caches()  # no trace made under the default setting is reused
    config = QuantizationConfig.for_method("rtn", bits=4, group_size=32, symmetric=False)
    quantized = quantize_model(model, config)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=length).tolist() for length in (1, 5, 17, 40, 70)]
    expected = generate(quantized, prompts, max_new_tokens=6, eos_token_ids=())
    assert expected != generate(model, prompts, max_new_tokens=6, eos_token_ids=()), (
        "quantization changed nothing: the comparison would not test the quantized path")
    engine = Engine(quantized, EngineConfig.from_options(page_size=16, max_num_batched_tokens=32,
                                            max_num_seqs=4, max_model_len=128,
                                            bucket_growth=4))
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt,
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    assert [outputs[str(index)] for index in range(len(prompts))] == expected


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_quant_matmul.available(),
                    reason="XLA:CPU's quantized-matmul kernel")
def test_a_blocks_projections_of_one_input_share_one_kernel_call(model, monkeypatch):
    # q, k and v (and gate and up) read the same input: one `matmul_many` call each set,
    # whose products equal one call per projection bit for bit.
    config = QuantizationConfig(method="rtn", rules=(
        QuantizationRule(r".", SCHEMES["int4-g32-asym"]),))
    quantized = quantize_model(model, config)
    tokens = jax.random.randint(jax.random.key(5), (1, 1), 0, 512)  # [B, T] a decode row
    text = jax.jit(lambda t: quantized(t)[0]).lower(tokens).as_text()
    assert text.count("jaxinfer_QuantMatmulMany") == 2 * get_preset("tiny").num_layers
    together = jax.jit(lambda t: quantized(t)[0])(tokens)  # [B, T, V]
    monkeypatch.setattr(QuantizedLinear, "call_together", lambda self, x, layers: None)
    apart_text = jax.jit(lambda t: quantized(t)[0]).lower(tokens).as_text()
    assert "jaxinfer_QuantMatmulMany" not in apart_text
    apart = jax.jit(lambda t: quantized(t)[0])(tokens)  # [B, T, V]
    np.testing.assert_array_equal(np.asarray(together), np.asarray(apart))
