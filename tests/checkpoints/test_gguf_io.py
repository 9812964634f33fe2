"""GGUF reading: the config from the metadata, llama's q/k row permutation undone on floats
and on quantized blocks, the float loader against transformers, and clear errors."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from checkpoints.gguf_io import (
    GGUFFile,
    GGUFFormatError,
    is_gguf_file,
    load_gguf_checkpoint,
    read_gguf_config,
)
from jaxinfer.config import ConfigError
from tests.gguf_files import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    VOCAB,
    TensorType,
    llama_cpp_permute,
    write_tiny_llama,
)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("io") / "q8.gguf", TensorType.Q8_0,
                            tied=True)


def test_config_comes_from_the_metadata(q8_file):
    config = read_gguf_config(q8_file, param_dtype="bfloat16")
    assert (config.model_type, config.num_layers, config.hidden_size,
            config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.vocab_size, config.max_position_embeddings) == (
        "llama", LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB, 256)
    assert config.rope_theta == 10000.0 and config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings  # no output.weight in the file
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert config.param_dtype == "bfloat16"


def test_a_mistral_named_llama_file_is_mistral(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", TensorType.F32, name="Mistral 7B Instruct")
    assert read_gguf_config(path).model_type == "mistral"


def test_the_q_k_permutation_is_undone_on_floats_and_blocks(q8_file):
    rng = np.random.default_rng(0)
    original = rng.normal(size=(HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)  # [O, I]
    config = read_gguf_config(q8_file)
    file = GGUFFile(q8_file)
    tensor = file.tensor("blk.0.attn_q.weight", config=config)
    assert tensor.heads == HEADS
    float_tensor = type(tensor)("q", TensorType.F32, original.shape,
                                llama_cpp_permute(original, HEADS), heads=HEADS)
    np.testing.assert_array_equal(float_tensor.rows(), original)
    blocks = gguf.quants.quantize(original, TensorType.Q8_0)  # [O, bytes]
    quantized = type(tensor)("q", TensorType.Q8_0, original.shape,
                             llama_cpp_permute(blocks, HEADS), heads=HEADS)
    np.testing.assert_array_equal(quantized.dequantize(),
                                  gguf.quants.dequantize(blocks, TensorType.Q8_0))
    # Value projections are not permuted.
    assert file.tensor("blk.0.attn_v.weight", config=config).heads is None


def test_the_float_loader_equals_transformers(tmp_path):
    path = write_tiny_llama(tmp_path / "q4k.gguf", TensorType.Q4_K)
    tokens = np.array([[1, 5, 77, 300, 12, 9]])  # [1, T]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.numpy()  # [1, T, V]
    actual, _ = load_gguf_checkpoint(path)(jnp.asarray(tokens))  # [1, T, V]
    assert float(np.max(np.abs(np.asarray(actual) - expected))) <= 1e-4


def test_errors_name_the_problem(tmp_path, q8_file):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    assert is_gguf_file(q8_file) and not is_gguf_file(not_gguf)
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(not_gguf)
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"general\.architecture.*'gpt2'"):
        read_gguf_config(tmp_path / "gpt2.gguf")
    with pytest.raises(GGUFFormatError, match=r"no tensor 'blk\.9\.attn_q\.weight'"):
        GGUFFile(q8_file).tensor("blk.9.attn_q.weight")
