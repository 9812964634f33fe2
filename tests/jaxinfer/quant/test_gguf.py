"""GGUF models: logits equal to transformers' own GGUF loader for every tensor type, Q8_0 /
Q4_0 / Q4_1 held as `QuantizedLinear` layers value for value, their memory, and a
tensor-parallel load."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from checkpoints.gguf_io import GGUFFile, GGUFTensor
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
from jaxinfer.llm import LLM
from jaxinfer.model_loading import load_model, load_model_config
from jaxinfer.quant import QuantizedLinear, linear_sites
from jaxinfer.quant.gguf import gguf_quantized_weight, gguf_weight_bytes, load_gguf_model
from jaxinfer.sharding import make_mesh
from pallas_kernels.quant_matmul import dequantize_weight
from tests.gguf_files import HIDDEN, INTERMEDIATE, TensorType, write_tiny_llama

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SERVED = {"Q8_0": ("int8_grouped", np.int8), "Q4_0": ("int4", np.uint8),
          "Q4_1": ("int4", np.uint8)}
TOKENS = np.array([[1, 17, 33, 99, 5, 250, 7, 300, 42, 2, 64, 128]])  # [1, T]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny llama GGUF per tensor type (Q4_1 also tied), in one directory."""
    directory = tmp_path_factory.mktemp("gguf")
    paths = {name: write_tiny_llama(directory / f"{name}.gguf", TensorType[name], seed=index)
             for index, name in enumerate(TYPES)}
    paths["Q4_1-tied"] = write_tiny_llama(directory / "Q4_1-tied.gguf", TensorType.Q4_1,
                                          tied=True, seed=99)
    return paths


def _transformers_logits(path) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()  # [1, T, V]


@pytest.mark.parametrize("name", [*TYPES, "Q4_1-tied"])
def test_logits_equal_transformers_gguf_loader(files, name):
    expected = _transformers_logits(files[name])  # [1, T, V]
    model = load_model(files[name])
    actual, _ = model(jnp.asarray(TOKENS))  # [1, T, V]
    assert actual.shape == expected.shape
    assert float(np.max(np.abs(expected))) > 0.1  # not a degenerate model
    assert float(np.max(np.abs(np.asarray(actual) - expected))) <= 1e-4
    served = SERVED.get(name.removesuffix("-tied"))
    for site in linear_sites(model):
        assert isinstance(site.layer, QuantizedLinear) == (served is not None), site.path
        if served is not None:
            weight = site.layer.weight
            assert (weight.format, weight.values.dtype, weight.group_size) == (
                served[0], served[1], 32), site.path
    if name.endswith("-tied"):
        # The tied head is served from the file's quantized table (the lookup keeps a float
        # copy): the same values, transposed.
        assert isinstance(model.lm_head, QuantizedLinear)
        np.testing.assert_allclose(np.asarray(model.lm_head.dequantized()),
                                   np.asarray(model.embed.weight[...]).T, rtol=0, atol=1e-6)
    else:
        assert isinstance(model.lm_head, QuantizedLinear) == (served is not None)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_served_weights_hold_gguf_values(files, name):
    """The registry weight dequantizes to gguf-py's values: exactly for Q8_0 and Q4_0, to
    float32 rounding of m / d for Q4_1."""
    file = GGUFFile(files[name])
    config = load_model_config(files[name])
    for tensor_name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight"):
        tensor = file.tensor(tensor_name, config=config)
        expected = tensor.dequantize().T  # [I, O]
        actual = np.asarray(dequantize_weight(gguf_quantized_weight(tensor)))  # [I, O]
        if name == "Q4_1":
            np.testing.assert_allclose(actual, expected, rtol=0, atol=4e-7 * np.max(
                np.abs(expected)))
        else:
            np.testing.assert_array_equal(actual, expected)


def test_q4_1_blocks_with_zero_scale_are_exact():
    rng = np.random.default_rng(3)
    blocks = np.zeros((4, 20), np.uint8)  # [O = 4, one block each]
    blocks[:, 2:4] = np.array([0.25, -1.5, 0.0, 3.0], np.float16)[:, None].view(np.uint8)
    blocks[:, 4:] = rng.integers(0, 256, (4, 16), dtype=np.uint8)  # q ignored: d = 0
    tensor = GGUFTensor("t", TensorType.Q4_1, (4, 32), blocks)
    expected = gguf.quants.dequantize(blocks, TensorType.Q4_1).T  # [32, 4]
    actual = np.asarray(dequantize_weight(gguf_quantized_weight(tensor)))
    np.testing.assert_array_equal(actual, expected)


def test_quantized_weights_take_a_fraction_of_the_float_bytes(files):
    float_bytes = gguf_weight_bytes(load_gguf_model(files["F32"]))
    per_weight = {name: gguf_weight_bytes(load_gguf_model(files[name])) for name in SERVED}
    # Projections and head: 5.5M weights at 4 bytes; the embedding table (gathered) stays
    # float32 in every model, so the ratios sit above 36/128 and 20/128 per weight.
    assert per_weight["Q8_0"] < 0.35 * float_bytes
    assert per_weight["Q4_0"] < per_weight["Q4_1"] < 0.25 * float_bytes


def test_a_gguf_model_splits_over_a_tensor_parallel_mesh(files):
    """Each quantized layer is split like the float weight it replaced, and the TP=2 engine's
    greedy output equals the one-device reference path."""
    mesh = make_mesh({"model": 2}, devices=jax.devices()[:2])
    sharded = load_model(files["Q4_1"], mesh=mesh)
    q_proj = sharded.layers[0].attention.q_proj
    down_proj = sharded.layers[0].mlp.down_proj
    assert q_proj.values[...].addressable_shards[0].data.shape == (HIDDEN // 2, HIDDEN // 2)
    assert q_proj.zeros[...].addressable_shards[0].data.shape == (HIDDEN // 32, HIDDEN // 2)
    assert down_proj.values[...].addressable_shards[0].data.shape == (INTERMEDIATE // 4,
                                                                       HIDDEN)
    assert down_proj.scales[...].addressable_shards[0].data.shape == (INTERMEDIATE // 64,
                                                                       HIDDEN)
    prompts = [[1, 5, 9], [1, 200, 3, 45, 67, 89, 101]]
    expected = generate(load_model(files["Q4_1"]), prompts, max_new_tokens=5,
                        eos_token_ids=())
    llm = LLM(files["Q4_1"], tensor_parallel_size=2, max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=64, bucket_growth=4)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [output.outputs[0].token_ids for output in outputs] == expected
