"""The correspondence between jaxinfer parameters and Hugging Face tensor names.

Each `TensorMapping` names one jaxinfer parameter (its NNX state path), the HF tensors it is
made of (one, or one per expert for Mixtral's stacked expert weights), their expected shapes,
and the two layout transforms. HF stores linear weights as `[out, in]`; we store `[in, out]`
with heads split out, e.g. a query projection `[D, N, H]` is HF's `[N*H, D]` transposed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxinfer.config import ModelConfig

ToParam = Callable[[list[np.ndarray]], np.ndarray]
ToHF = Callable[[np.ndarray], list[np.ndarray]]

# Tensors some checkpoints carry that hold no parameters of ours (precomputed RoPE tables).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """One jaxinfer parameter and the HF tensors it is made of."""

    param_path: tuple[str | int, ...]
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_param: ToParam
    to_hf: ToHF


def _single(path: tuple[str | int, ...], name: str, shape: tuple[int, ...],
            to_param: Callable[[np.ndarray], np.ndarray],
            to_hf: Callable[[np.ndarray], np.ndarray]) -> TensorMapping:
    return TensorMapping(path, (name,), (shape,), lambda arrays: to_param(arrays[0]),
                         lambda array: [to_hf(array)])


def _identity(array: np.ndarray) -> np.ndarray:
    return array


def _transpose(array: np.ndarray) -> np.ndarray:
    return array.T


def _heads_in(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """[heads*H, D] (HF q/k/v) <-> [D, heads, H] (ours)."""
    def to_param(array: np.ndarray) -> np.ndarray:
        return array.T.reshape(array.shape[1], heads, head_dim)

    def to_hf(array: np.ndarray) -> np.ndarray:
        return array.reshape(array.shape[0], heads * head_dim).T
    return to_param, to_hf


def _heads_out(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """[D, N*H] (HF o_proj) <-> [N, H, D] (ours)."""
    def to_param(array: np.ndarray) -> np.ndarray:
        return array.T.reshape(heads, head_dim, array.shape[0])

    def to_hf(array: np.ndarray) -> np.ndarray:
        return array.reshape(heads * head_dim, array.shape[-1]).T
    return to_param, to_hf


def _bias(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """[heads*H] (HF) <-> [heads, H] (ours)."""
    return (lambda array: array.reshape(heads, head_dim),
            lambda array: array.reshape(heads * head_dim))


def _experts(names: tuple[str, ...], shape: tuple[int, ...], path: tuple[str | int, ...]
             ) -> TensorMapping:
    """Per-expert HF linear weights `[out, in]` <-> our stacked `[E, in, out]`."""
    return TensorMapping(
        path, names, (shape,) * len(names),
        lambda arrays: np.stack([array.T for array in arrays]),
        lambda array: [expert.T for expert in array],
    )


def tensor_mappings(config: ModelConfig) -> list[TensorMapping]:
    """Every parameter of a model built from `config`, with its HF tensors."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    mappings = [_single(("embed", "weight"), "model.embed_tokens.weight", (v, d),
                        _identity, _identity)]
    for layer in range(config.num_layers):
        hf = f"model.layers.{layer}"
        ours: tuple[str | int, ...] = ("layers", layer)
        # A HARP block (the top config.num_harp_layers) has no q/k projections: its
        # safetensors lack them, which HF transformers cannot run (docs/pruning.md).
        harp = config.harp_alpha(layer) is not None
        mappings += [
            _single(ours + ("input_norm", "weight"), f"{hf}.input_layernorm.weight", (d,),
                    _identity, _identity),
            _single(ours + ("post_attention_norm", "weight"),
                    f"{hf}.post_attention_layernorm.weight", (d,), _identity, _identity),
        ]
        if not harp:
            mappings += [
                _single(ours + ("attention", "q_proj"), f"{hf}.self_attn.q_proj.weight",
                        (n * h, d), *_heads_in(n, h)),
                _single(ours + ("attention", "k_proj"), f"{hf}.self_attn.k_proj.weight",
                        (k * h, d), *_heads_in(k, h)),
            ]
        mappings += [
            _single(ours + ("attention", "v_proj"), f"{hf}.self_attn.v_proj.weight",
                    (k * h, d), *_heads_in(k, h)),
            _single(ours + ("attention", "o_proj"), f"{hf}.self_attn.o_proj.weight",
                    (d, n * h), *_heads_out(n, h)),
        ]
        if config.attention_bias:
            for name, heads in (("v", k),) if harp else (("q", n), ("k", k), ("v", k)):
                mappings.append(_single(ours + ("attention", f"{name}_bias"),
                                        f"{hf}.self_attn.{name}_proj.bias", (heads * h,),
                                        *_bias(heads, h)))
        if config.is_moe:
            moe = f"{hf}.block_sparse_moe"
            experts = range(config.num_experts)
            mappings += [
                _single(ours + ("mlp", "router"), f"{moe}.gate.weight",
                        (config.num_experts, d), _transpose, _transpose),
                # Mixtral names: w1 = gate, w3 = up, w2 = down.
                _experts(tuple(f"{moe}.experts.{e}.w1.weight" for e in experts), (f, d),
                         ours + ("mlp", "gate_proj")),
                _experts(tuple(f"{moe}.experts.{e}.w3.weight" for e in experts), (f, d),
                         ours + ("mlp", "up_proj")),
                _experts(tuple(f"{moe}.experts.{e}.w2.weight" for e in experts), (d, f),
                         ours + ("mlp", "down_proj")),
            ]
        else:
            mappings += [
                _single(ours + ("mlp", "gate_proj"), f"{hf}.mlp.gate_proj.weight", (f, d),
                        _transpose, _transpose),
                _single(ours + ("mlp", "up_proj"), f"{hf}.mlp.up_proj.weight", (f, d),
                        _transpose, _transpose),
                _single(ours + ("mlp", "down_proj"), f"{hf}.mlp.down_proj.weight", (d, f),
                        _transpose, _transpose),
            ]
    mappings.append(_single(("final_norm", "weight"), "model.norm.weight", (d,),
                            _identity, _identity))
    if not config.tie_word_embeddings:
        mappings.append(_single(("lm_head",), "lm_head.weight", (v, d), _transpose,
                                _transpose))
    return mappings
