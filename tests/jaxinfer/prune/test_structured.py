"""Structured pruning: the smaller dense model computes exactly what the original computes with
the same structures switched off, its sizes are the requested ones, importance finds the
structures a constructed model makes unimportant, and the pruned model is served by the
engine (one device and tensor parallel) and by HF transformers like any other model."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from checkpoints import load_hf_checkpoint, save_hf_checkpoint
from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.factory import build_engine
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
from jaxinfer.models import create_model
from jaxinfer.prune.structured import (
    PruningPlan,
    StructuredPruning,
    apply_plan,
    structured_prune,
)
from tests.tiny_hf import hf_logits, relative_error

# 4 layers of 4 KV groups of 2 query heads, so every structure has several candidates.
CONFIG = get_preset("tiny").replace(num_layers=4, num_heads=8, num_kv_heads=4)
SPEC = StructuredPruning(heads=0.5, mlp=0.25, layers=1)
PROMPTS = [[1, 17, 33, 99, 5], [1, 200, 3, 45, 67, 89, 101, 123, 145, 167, 189, 211, 7],
           [1, 250, 240, 230, 220, 210, 200, 190, 180, 170, 160, 150, 140, 130, 120, 110]]


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=3)


@pytest.fixture(scope="module")
def windows() -> np.ndarray:
    return np.random.default_rng(0).integers(3, CONFIG.vocab_size, (4, 24)).astype(np.int32)


@pytest.fixture(scope="module")
def pruned(model, windows):
    return structured_prune(model, "heads=0.5,mlp=0.25,layers=1", windows)


def _ids(prompts: list[list[int]]) -> jax.Array:
    width = max(len(prompt) for prompt in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    return jnp.asarray(ids)  # [B, T]


def _valid(logits: np.ndarray, prompts: list[list[int]]) -> np.ndarray:
    return np.concatenate([logits[row, : len(prompt)] for row, prompt in enumerate(prompts)])


def _zeroed_reference_logits(model, plan: PruningPlan, token_ids: jax.Array) -> np.ndarray:
    """The original model with the structures `plan` drops switched off by hand: a removed
    KV group's query heads get zero o_proj rows, a removed channel a zero down_proj row, and
    a removed layer is skipped by the residual stream."""
    model = nnx.clone(model)
    group_size = model.config.group_size
    for index, block in enumerate(model.layers):
        o_proj = block.attention.o_proj[...]  # [N, H, D]
        head_kept = np.isin(np.arange(o_proj.shape[0]) // group_size, plan.kv_groups[index])
        block.attention.o_proj[...] = o_proj * head_kept[:, None, None]
        down = block.mlp.down_proj[...]  # [F, D]
        block.mlp.down_proj[...] = down * np.isin(np.arange(down.shape[0]),
                                                  plan.channels[index])[:, None]
    positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1]), token_ids.shape)  # [B, T]
    x = model.embed_tokens(token_ids)  # [B, T, D]
    for index in plan.layers:
        x, _ = model.layers[index](x, positions, None)  # [B, T, D]
    return np.asarray(model.logits(model.final_norm(x)))  # [B, T, V]


def _parameter_count(model) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ---------------------------------------------------------------------------- the spec


def test_spec_parses_the_cli_spelling():
    assert StructuredPruning.parse("heads=0.25,mlp=0.3,layers=2") == StructuredPruning(
        heads=0.25, mlp=0.3, layers=2)
    assert StructuredPruning.parse(" layers=1 ") == StructuredPruning(layers=1)
    for bad in ("heads=1.0", "mlp=-0.1", "layers=1.5", "layers=-1", "width=0.5", "heads",
                "heads=0.1,heads=0.2", "mlp=lots", "mlp_multiple=0.5"):
        with pytest.raises(ValueError):
            StructuredPruning.parse(bad)


def test_kept_mlp_width_is_rounded_up_to_the_multiple():
    # 128 channels, 30% removed: 90 kept, rounded up to 96 (a multiple of 32).
    assert StructuredPruning(mlp=0.3).removed_counts(CONFIG) == (0, 38, 0)
    spec = StructuredPruning.parse("mlp=0.3,mlp_multiple=32,heads=0.25")
    assert spec.removed_counts(CONFIG) == (1, 32, 0)
    assert StructuredPruning(mlp=0.3, mlp_multiple=256).removed_counts(CONFIG) == (0, 0, 0)
    with pytest.raises(ValueError, match="mlp_multiple"):
        StructuredPruning(mlp_multiple=0)


def test_spec_that_removes_everything_is_refused(model, windows):
    for spec in ("layers=4", "heads=0.9"):
        with pytest.raises(ValueError, match="removes all"):
            structured_prune(model, spec, windows)
    with pytest.raises(ValueError, match="importance"):
        structured_prune(model, SPEC, windows, importance="random")


# ---------------------------------------------------------------------------- sizes


def test_pruned_config_has_the_requested_sizes(model, pruned):
    config = pruned.config
    assert (config.num_kv_heads, config.num_heads, config.intermediate_size,
            config.num_layers) == (2, 4, 96, 3)
    assert config.head_dim == CONFIG.head_dim and config.group_size == CONFIG.group_size
    d, h, v = CONFIG.hidden_size, CONFIG.head_dim, CONFIG.vocab_size

    def expected(layers: int, heads: int, kv_heads: int, mlp: int) -> int:
        block = 2 * d + d * heads * h + 2 * d * kv_heads * h + heads * h * d + 3 * d * mlp
        return 2 * v * d + d + layers * block  # embedding, LM head, final norm, blocks

    assert _parameter_count(model) == expected(4, 8, 4, 128)
    assert _parameter_count(pruned) == expected(3, 4, 2, 96)
    # The blocks lose 1/4 of the layers, half the attention and 1/4 of the MLP of the rest:
    # 47% of their weights stay; the (unpruned) embedding and head hold the remainder.
    block_weights = _parameter_count(pruned) - 2 * v * d - d
    assert math.isclose(block_weights / (_parameter_count(model) - 2 * v * d - d),
                        3 / 4 * (128 + 24 * 64 * 16 / 2 + 3 * 64 * 96) / (
                            128 + 24 * 64 * 16 + 3 * 64 * 128))


def test_zero_pruning_leaves_the_model_unchanged(model, windows):
    same = structured_prune(model, StructuredPruning(), windows)
    assert same.config == model.config
    ids = _ids(PROMPTS)
    np.testing.assert_array_equal(np.asarray(same(ids)[0]), np.asarray(model(ids)[0]))


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("attention_bias", [False, True])
def test_removal_equals_zeroing_the_same_structures(attention_bias):
    model = create_model(CONFIG.replace(attention_bias=attention_bias), seed=4)
    if attention_bias:  # nonzero biases, so their slicing matters
        for block in model.layers:
            for name in ("q_bias", "k_bias", "v_bias"):
                bias = getattr(block.attention, name)
                bias[...] = 0.1 * jax.random.normal(jax.random.key(hash(name) % 97),
                                                    bias[...].shape)
    rng = np.random.default_rng(5)
    plan = PruningPlan(
        kv_groups=tuple(tuple(sorted(rng.choice(4, 2, replace=False))) for _ in range(4)),
        channels=tuple(tuple(sorted(rng.choice(128, 80, replace=False))) for _ in range(4)),
        layers=(0, 2, 3))
    assert len(set(plan.kv_groups)) > 1  # layers keep different groups
    pruned = apply_plan(model, plan)
    ids = _ids(PROMPTS)
    ours = np.asarray(pruned(ids)[0])  # [B, T, V]
    reference = _zeroed_reference_logits(model, plan, ids)  # [B, T, V]
    np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=1e-5)
    # And it is a real change: the unpruned model gives other logits.
    assert not np.allclose(np.asarray(model(ids)[0]), ours, atol=1e-3)


# ---------------------------------------------------------------------------- serving


def _engine_tokens(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    return [list(outputs[str(index)]) for index in range(len(prompts))]


ENGINE_OPTIONS = dict(page_size=8, max_num_batched_tokens=64, max_num_seqs=4,
                      max_model_len=128, enable_prompt_logprobs=False)


@pytest.fixture(scope="module")
def pruned_reference_tokens(pruned) -> list[list[int]]:
    return generate(pruned, PROMPTS, max_new_tokens=8, eos_token_ids=())


def test_engine_serves_the_pruned_model_like_reference_generation(pruned,
                                                                  pruned_reference_tokens):
    engine = Engine(pruned, EngineConfig.from_options(**ENGINE_OPTIONS))
    assert _engine_tokens(engine, PROMPTS, 8) == pruned_reference_tokens


def test_tensor_parallel_engine_serves_the_pruned_model(pruned, pruned_reference_tokens):
    # The 2 KV groups left split one per device.
    engine = build_engine(pruned, EngineConfig.from_options(**ENGINE_OPTIONS,
                                                            tensor_parallel_size=2))
    assert len(engine.runner.pages.sharding.device_set) == 2
    assert _engine_tokens(engine, PROMPTS, 8) == pruned_reference_tokens


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pruned_checkpoint_loads_in_transformers_with_the_same_logits(family, pruned, windows,
                                                                     tmp_path):
    if family == "qwen2":  # q/k/v biases and tied embeddings, pruned by Taylor importance
        original = create_model(CONFIG.replace(model_type="qwen2", attention_bias=True,
                                               tie_word_embeddings=True), seed=8)
        pruned = structured_prune(original, SPEC, windows, importance="taylor")
    directory = save_hf_checkpoint(pruned, tmp_path / "pruned")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager").eval()
    assert hf_model.config.model_type == family
    assert hf_model.config.num_hidden_layers == 3
    assert hf_model.config.num_key_value_heads == 2 and hf_model.config.intermediate_size == 96
    ours = np.asarray(pruned(_ids(PROMPTS))[0])  # [B, T, V]
    error = relative_error(_valid(hf_logits(hf_model, PROMPTS), PROMPTS), _valid(ours, PROMPTS))
    assert error < 1e-4, error
    reloaded = load_hf_checkpoint(directory)
    assert reloaded.config == pruned.config
    assert _parameter_count(reloaded) == _parameter_count(pruned)
