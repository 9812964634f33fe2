"""HF checkpoint loading: clear errors, sharded placement, one tensor at a time on the host."""

from __future__ import annotations

import json
import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints import CheckpointMismatchError, load_hf_checkpoint, save_hf_checkpoint
from checkpoints.safetensors_io import SafetensorsFile, write_safetensors
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.models import create_model
from jaxinfer.sharding import ShardingError, describe, make_mesh
from tests.tiny_hf import PROMPTS, hf_logits, relative_error, save_hf_model


@pytest.fixture(scope="module")
def llama_directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", directory)
    return directory


def _copy_with(tmp_path, source, edit_tensors=None, edit_config=None):
    """A copy of `source` whose tensors/config were changed by the edit functions."""
    handle = SafetensorsFile(source / "model.safetensors")
    tensors = {name: handle.read(name) for name in handle.keys()}
    if edit_tensors:
        edit_tensors(tensors)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    config = json.loads((source / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_missing_tensor_is_named(llama_directory, tmp_path):
    directory = _copy_with(tmp_path, llama_directory,
                           lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointMismatchError, match=r"missing.*layers\.1\.mlp\.up_proj"):
        load_hf_checkpoint(directory)


def test_unexpected_tensor_is_named(llama_directory, tmp_path):
    def add(tensors):
        tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointMismatchError, match=r"unexpected.*layers\.0\.extra\.weight"):
        load_hf_checkpoint(_copy_with(tmp_path, llama_directory, add))


def test_misshaped_tensor_names_both_shapes(llama_directory, tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    with pytest.raises(CheckpointMismatchError,
                       match=r"k_proj\.weight' has shape \(16, 64\).*implies \(32, 64\)"):
        load_hf_checkpoint(_copy_with(tmp_path, llama_directory, shrink))


def test_unsupported_model_type_is_named(llama_directory, tmp_path):
    directory = _copy_with(tmp_path, llama_directory,
                           edit_config=lambda c: c.update(model_type="gemma"))
    with pytest.raises(ConfigError, match="'model_type' = 'gemma'"):
        load_hf_checkpoint(directory)


def test_no_weights_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
        num_kv_heads=1).to_hf()))
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_bf16_checkpoint_loads_with_its_dtype(llama_directory, tmp_path):
    model = load_hf_checkpoint(llama_directory)
    exported = save_hf_checkpoint(model, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = load_hf_checkpoint(exported)
    assert reloaded.config.param_dtype == "bfloat16"
    assert reloaded.layers[0].attention.q_proj[...].dtype == jnp.bfloat16


def test_load_onto_a_mesh_places_every_tensor(tmp_path):
    directory = tmp_path / "wide"
    # 8 kv heads so every split divides over 4 model shards.
    hf_model = save_hf_model("qwen2", directory, num_attention_heads=8, num_key_value_heads=8,
                             head_dim=8)
    model = load_hf_checkpoint(directory, mesh=make_mesh((2, 4)))
    specs = describe(nnx.state(model))
    assert tuple(specs["layers.0.attention.k_bias"]) == ("model", None)
    assert tuple(specs["embed.weight"]) == ("model", None)
    width = max(len(p) for p in PROMPTS)
    ids = np.zeros((len(PROMPTS), width), np.int32)
    for row, prompt in enumerate(PROMPTS):
        ids[row, : len(prompt)] = prompt
    ours = np.asarray(model(jnp.asarray(ids))[0])
    reference = hf_logits(hf_model, PROMPTS)
    valid = [(row, slice(0, len(p))) for row, p in enumerate(PROMPTS)]
    assert relative_error(np.concatenate([ours[r, s] for r, s in valid]),
                          np.concatenate([reference[r, s] for r, s in valid])) < 1e-4


def test_load_onto_an_indivisible_mesh_fails_before_reading(llama_directory):
    with pytest.raises(ShardingError, match="kv_heads"):
        load_hf_checkpoint(llama_directory, mesh=make_mesh((1, 8)))


def test_host_memory_peaks_near_one_tensor(tmp_path):
    # 6 layers of 128-wide blocks: the model is many times its largest tensor.
    config = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=6,
                         num_heads=4, num_kv_heads=2)
    model = create_model(config)
    directory = save_hf_checkpoint(model, tmp_path / "ckpt")
    sizes = [variable.get_value().nbytes for _, variable in nnx.to_flat_state(nnx.state(model))]
    tracemalloc.start()
    loaded = load_hf_checkpoint(directory)
    retained, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert loaded.config == config
    # On the CPU backend device arrays may alias the NumPy buffers they were put from, so
    # what stays allocated is the model itself; the staging memory is the excess of the peak
    # over it: one tensor read plus its converted copy, plus bookkeeping.
    staging = peak - retained
    assert staging < 2.5 * max(sizes) + 200_000, (staging, max(sizes), sum(sizes))
    assert staging < sum(sizes) / 4
