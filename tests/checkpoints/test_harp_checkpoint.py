"""HARP checkpoints: an HF directory without the HARP layers' q/k tensors and with the
`jaxinfer_harp` config.json key, saved and loaded back to identical logits (float and
quantized), and clear errors when the config and the tensors disagree."""

from __future__ import annotations

import json

import numpy as np
import pytest

from checkpoints import CheckpointMismatchError, load_hf_checkpoint, save_hf_checkpoint
from checkpoints.safetensors_io import SafetensorsFile
from jaxinfer.config import get_preset
from jaxinfer.model_loading import load_model
from jaxinfer.models import create_model
from jaxinfer.prune.harp import to_harp
from jaxinfer.quant import QuantizationConfig, quantize_model
from jaxinfer.quant.checkpoint import save_quantized_model

# q/k/v biases on (Qwen2-like), so the HARP layers' v bias is saved and q/k biases are not.
DENSE = get_preset("tiny").replace(model_type="qwen2", num_layers=4, attention_bias=True,
                                   bos_token_id=None)
IDS = np.array([[5, 9, 31, 2, 77, 400, 12]], np.int32)  # [B, T]


@pytest.fixture(scope="module")
def model():
    return to_harp(create_model(DENSE, seed=2), (0.25, 1.0))


@pytest.fixture(scope="module")
def directory(model, tmp_path_factory):
    return save_hf_checkpoint(model, tmp_path_factory.mktemp("harp"))


def test_round_trip_gives_identical_logits(model, directory):
    names = set(SafetensorsFile(directory / "model.safetensors").keys())
    for layer in (2, 3):
        for projection in ("q_proj", "k_proj"):
            assert f"model.layers.{layer}.self_attn.{projection}.weight" not in names
            assert f"model.layers.{layer}.self_attn.{projection}.bias" not in names
        assert f"model.layers.{layer}.self_attn.v_proj.bias" in names
    assert "model.layers.1.self_attn.q_proj.weight" in names
    config = json.loads((directory / "config.json").read_text())
    assert config["jaxinfer_harp"] == {"layers": [2, 3], "alphas": [0.25, 1.0]}
    restored = load_hf_checkpoint(directory)
    assert restored.config.harp_alphas == (0.25, 1.0)
    np.testing.assert_array_equal(restored(IDS)[0], model(IDS)[0])
    np.testing.assert_array_equal(load_model(directory)(IDS)[0], model(IDS)[0])


def test_quantized_round_trip_gives_identical_logits(model, tmp_path):
    config = QuantizationConfig.for_method("rtn", bits=8)
    quantized = quantize_model(model, config)
    restored = load_model(save_quantized_model(quantized, config, tmp_path / "int8"))
    assert restored.config.harp_alphas == (0.25, 1.0)
    np.testing.assert_array_equal(restored(IDS)[0], quantized(IDS)[0])


def test_a_config_without_the_harp_key_names_it(directory, tmp_path):
    for name in ("model.safetensors", "generation_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    config = json.loads((directory / "config.json").read_text())
    del config["jaxinfer_harp"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatchError,
                       match=r"missing.*q_proj.*a HARP model's top layers have none.*"
                             r"'jaxinfer_harp'.*0 of 4"):
        load_hf_checkpoint(tmp_path)
