"""ModelConfig: HF parsing for every family, validation messages, presets."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.config import PRESETS, ConfigError, ModelConfig, RopeScaling, get_preset

LLAMA = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": [2, 3]}


def test_llama_fields():
    config = ModelConfig.from_hf(LLAMA)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
    assert config.rope_theta == 500000.0 and config.rope_scaling.rope_type == "default"
    assert config.eos_token_ids == (2, 3) and config.group_size == 2
    assert not config.is_moe and config.sliding_window is None


def test_llama3_scaling_in_both_spellings():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old = ModelConfig.from_hf({**LLAMA, "rope_scaling": scaling})
    new = ModelConfig.from_hf({**LLAMA, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old == new
    assert old.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)


def test_linear_scaling_and_legacy_type_key():
    config = ModelConfig.from_hf({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 2.0


def test_mistral_qwen2_mixtral():
    mistral = ModelConfig.from_hf({**LLAMA, "model_type": "mistral", "sliding_window": 16})
    assert mistral.sliding_window == 16
    qwen = ModelConfig.from_hf({**LLAMA, "model_type": "qwen2", "tie_word_embeddings": True,
                                "sliding_window": 16, "use_sliding_window": False})
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.sliding_window is None
    mixtral = ModelConfig.from_hf({**LLAMA, "model_type": "mixtral", "num_local_experts": 8,
                                   "num_experts_per_tok": 2})
    assert mixtral.is_moe and mixtral.num_experts == 8 and mixtral.num_experts_per_token == 2


def test_roundtrip_through_hf_dict_and_plain_dict():
    for name, preset in PRESETS.items():
        assert ModelConfig.from_hf(preset.to_hf(), dtype=preset.dtype) == preset, name
        assert ModelConfig.from_dict(preset.to_dict()) == preset, name


@pytest.mark.parametrize(("changes", "field", "value"), [
    ({"model_type": "gpt2"}, "model_type", "'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act", "'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type", "'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor",
     "None"),
    ({"num_key_value_heads": 3}, "num_kv_heads", "3"),
    ({"vocab_size": 0}, "vocab_size", "0"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "max_window_layers": 1}, "max_window_layers", "1"),
    ({"mlp_bias": True}, "mlp_bias", "True"),
])
def test_bad_config_names_field_and_value(changes, field, value):
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_hf({**LLAMA, **changes})
    assert f"{field!r} = {value}" in str(error.value)


def test_missing_required_field_is_named():
    hf = dict(LLAMA)
    del hf["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size'"):
        ModelConfig.from_hf(hf)


def test_frozen_and_keyword_only():
    config = get_preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.vocab_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig("llama", 1, 2, 3, 4, 5, 6)  # type: ignore[misc]
    with pytest.raises(ConfigError, match="'dtype' = 'int8'"):
        config.replace(dtype="int8")


def test_presets_exact_name_lookup():
    assert get_preset("tiny") is PRESETS["tiny"]
    assert get_preset("llama-3.1-8b").rope_scaling.rope_type == "llama3"
    with pytest.raises(KeyError, match="unknown preset 'Tiny'"):
        get_preset("Tiny")
