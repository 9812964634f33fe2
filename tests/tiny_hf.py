"""Tiny random Hugging Face checkpoints made inside the tests (nothing is downloaded).

Each family gets a config small enough to run in seconds but exercising its distinctive parts:
llama3 RoPE scaling, a sliding window shorter than the prompts, q/k/v biases with tied
embeddings, and a 4-expert top-2 MoE. Every parameter, norms and biases included, is redrawn
at random so that no weight is a trivial 0 or 1 that could hide a layout bug.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)

FAMILIES: dict[str, tuple[type, type, dict]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        sliding_window=6)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        tie_word_embeddings=True, use_sliding_window=False)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
}

# Right-padded batch of prompts of different lengths (longer than the Mistral window).
PROMPTS = [
    [1, 17, 33, 99, 5],
    [1, 200, 3, 45, 67, 89, 101, 123, 145, 167, 189, 211, 7],
    [1, 250, 240, 230, 220, 210, 200, 190, 180, 170, 160, 150, 140, 130, 120, 110, 100, 90,
     80, 70],
]


def make_hf_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random-init float32 transformers model of `family`, in eval mode."""
    config_class, model_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * noise)
            else:
                parameter.copy_(0.08 * noise)
    return model


def save_hf_model(family: str, directory: Path, seed: int = 0,
                  **overrides) -> transformers.PreTrainedModel:
    """Makes and saves a tiny model of `family` to `directory`; returns the model."""
    model = make_hf_model(family, seed, **overrides)
    model.save_pretrained(directory)
    return model


def hf_logits(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> np.ndarray:
    """transformers' float32 logits for a right-padded batch, `[B, T, V]`."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
        mask[row, : len(prompt)] = 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float().numpy()


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int],
              max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (prompt removed)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """Norm of the difference over the norm of the reference."""
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))
