"""jaxinfer's models are the same function as transformers' on the same weights.

For each family: logits for a right-padded batch (fp32 within 1e-4 relative, bf16 within
2e-2), greedy 32-token continuations token-identical to `generate`, and the same after
exporting our parameters back to an HF directory and reloading it in transformers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from checkpoints import load_hf_checkpoint, save_hf_checkpoint
from jaxinfer.generate import generate
from tests.tiny_hf import FAMILIES, PROMPTS, hf_greedy, hf_logits, relative_error, save_hf_model

FAMILY_NAMES = sorted(FAMILIES)


def _our_logits(model, prompts: list[list[int]]) -> np.ndarray:
    width = max(len(prompt) for prompt in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    logits, _ = model(jnp.asarray(ids))
    return np.asarray(logits)  # [B, T, V]


def _valid(logits: np.ndarray, prompts: list[list[int]]) -> np.ndarray:
    # Padding positions are not compared: only real tokens have defined outputs.
    return np.concatenate([logits[row, : len(prompt)] for row, prompt in enumerate(prompts)])


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family_checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(request.param, directory)
    return request.param, directory, hf_model, hf_logits(hf_model, PROMPTS)


def test_config_reads_family_features(family_checkpoint):
    family, directory, _, _ = family_checkpoint
    config = load_hf_checkpoint(directory).config
    if family == "llama3_rope":
        assert config.rope_scaling.rope_type == "llama3"
    if family == "mistral":
        assert config.sliding_window == 6 < max(len(prompt) for prompt in PROMPTS)
    if family == "qwen2":
        assert config.attention_bias and config.tie_word_embeddings
    if family == "mixtral":
        assert (config.num_experts, config.num_experts_per_token) == (4, 2)


def test_fp32_logits_match_transformers(family_checkpoint):
    _, directory, _, reference = family_checkpoint
    model = load_hf_checkpoint(directory)
    error = relative_error(_valid(_our_logits(model, PROMPTS), PROMPTS),
                           _valid(reference, PROMPTS))
    assert error < 1e-4, error


def test_bf16_logits_match_transformers(family_checkpoint):
    _, directory, _, reference = family_checkpoint
    model = load_hf_checkpoint(directory, param_dtype="bfloat16", dtype="bfloat16")
    assert model.embed.weight[...].dtype == jnp.bfloat16
    error = relative_error(_valid(_our_logits(model, PROMPTS), PROMPTS),
                           _valid(reference, PROMPTS))
    assert error < 2e-2, error


def test_greedy_continuations_match_transformers(family_checkpoint):
    _, directory, hf_model, _ = family_checkpoint
    model = load_hf_checkpoint(directory)
    ours = generate(model, PROMPTS, max_new_tokens=32)
    theirs = [hf_greedy(hf_model, prompt, 32) for prompt in PROMPTS]
    assert ours == theirs


def test_export_roundtrip_through_transformers(family_checkpoint, tmp_path):
    _, directory, hf_model, reference = family_checkpoint
    model = load_hf_checkpoint(directory)
    exported = save_hf_checkpoint(model, tmp_path / "export", max_shard_bytes=40_000)
    assert (exported / "model.safetensors.index.json").exists()  # sharded path exercised
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    assert relative_error(_valid(hf_logits(reloaded, PROMPTS), PROMPTS),
                          _valid(reference, PROMPTS)) < 1e-6
    assert [hf_greedy(reloaded, p, 32) for p in PROMPTS] == generate(
        load_hf_checkpoint(exported), PROMPTS, max_new_tokens=32)
