"""prune_model: every block linear pruned (never the head), layers fed inputs recomputed
through the already-pruned layers, pruned checkpoints that transformers loads with the same
logits, and joint sparse + quantized checkpoints that restore with their zeros."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from checkpoints import load_hf_checkpoint, save_hf_checkpoint
from jaxinfer.config import get_preset
from jaxinfer.model_loading import load_model
from jaxinfer.models import create_model
from jaxinfer.prune import PruningConfig, prune_model
from jaxinfer.quant import (
    QuantizationConfig,
    QuantizationRule,
    WeightScheme,
    linear_sites,
    quantize_model,
    save_quantized_model,
)
from jaxinfer.quant.calibration import INPUT_SITE, collect_block_inputs
from jaxinfer.quant.linear import QuantizedLinear
from tests.tiny_hf import PROMPTS, hf_logits, relative_error, save_hf_model

WINDOWS = np.random.default_rng(0).integers(3, 200, size=(4, 32))  # [B, T]


@pytest.fixture(scope="module")
def tiny_model():
    return create_model(get_preset("tiny"), seed=0)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_every_block_linear_is_pruned_and_the_head_is_not(tiny_model, method):
    pruned = prune_model(tiny_model, PruningConfig.for_method(method, pattern=(2, 4)), WINDOWS,
                         progress=False)
    for site, original in zip(linear_sites(pruned), linear_sites(tiny_model), strict=True):
        matrix = np.asarray(site.float_matrix())  # [I, O]
        if site.path == "lm_head":
            np.testing.assert_array_equal(matrix, np.asarray(original.float_matrix()))
        else:
            zeros = np.sum(matrix.reshape(-1, 4, matrix.shape[1]) == 0, axis=1)  # [I / 4, O]
            assert np.all(zeros == 2), site.path
    assert np.all(np.asarray(linear_sites(tiny_model)[0].float_matrix()) != 0)  # unchanged
    np.testing.assert_array_equal(pruned.embed.weight[...],
                                  tiny_model.embed.weight[...])


def test_layers_see_inputs_through_the_already_pruned_layers(tiny_model):
    seen = {}

    def on_layer(site, inputs, matrix, pruned):
        seen[site.path] = np.asarray(inputs)

    pruned = prune_model(tiny_model, PruningConfig.for_method("wanda", sparsity=0.5), WINDOWS,
                         on_layer=on_layer, progress=False)
    # A group's inputs depend only on the groups before it, so the pruned model's own
    # inputs at each site are what the site was pruned on.
    through_pruned = collect_block_inputs(pruned, WINDOWS)
    through_dense = collect_block_inputs(tiny_model, WINDOWS)
    for path, inputs in seen.items():
        index = int(path.split(".")[1])
        capture = INPUT_SITE[path.rsplit(".", 1)[1]]
        np.testing.assert_allclose(inputs, through_pruned[index][capture], rtol=1e-5,
                                   atol=1e-6)
    assert not np.allclose(seen["layers.1.mlp.down_proj"],
                           through_dense[1]["mlp_hidden"], atol=1e-3)


def test_magnitude_needs_no_calibration_but_wanda_does(tiny_model):
    pruned = prune_model(tiny_model, PruningConfig.for_method("magnitude", sparsity=0.25),
                         progress=False)
    assert np.mean(np.asarray(linear_sites(pruned)[0].float_matrix()) == 0) == 0.25
    with pytest.raises(ValueError, match="calibration"):
        prune_model(tiny_model, PruningConfig.for_method("wanda", sparsity=0.25))


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_pruned_checkpoint_gives_transformers_our_logits(tmp_path, method):
    save_hf_model("llama", tmp_path / "dense")
    model = load_hf_checkpoint(tmp_path / "dense")
    windows = np.random.default_rng(1).integers(3, 256, size=(4, 32))  # [B, T]
    pruned = prune_model(model, PruningConfig.for_method(method, sparsity=0.5), windows,
                         progress=False)
    save_hf_checkpoint(pruned, tmp_path / "pruned")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pruned",
                                                             torch_dtype=torch.float32).eval()
    hf_model.config._attn_implementation = "eager"
    q_proj = hf_model.model.layers[0].self_attn.q_proj.weight.detach().numpy()  # [O, I]
    assert np.mean(q_proj == 0) == 0.5
    assert np.all(hf_model.lm_head.weight.detach().numpy() != 0)
    width = max(len(prompt) for prompt in PROMPTS)
    ids = np.zeros((len(PROMPTS), width), np.int32)
    for row, prompt in enumerate(PROMPTS):
        ids[row, :len(prompt)] = prompt
    ours, _ = pruned(jnp.asarray(ids))  # [B, T, V]
    reference = hf_logits(hf_model, PROMPTS)  # [B, T, V]
    for row, prompt in enumerate(PROMPTS):
        assert relative_error(np.asarray(ours)[row, :len(prompt)],
                              reference[row, :len(prompt)]) < 1e-4
    dense_reference = hf_logits(transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "dense").eval(), PROMPTS)
    assert relative_error(reference, dense_reference) > 1e-2  # pruning did change the model


def test_joint_sparse_quantized_checkpoint_restores_with_its_zeros(tmp_path, tiny_model):
    config = PruningConfig.for_method("sparsegpt", pattern=(2, 4), bits=4, group_size=32)
    pruned = prune_model(tiny_model, config, WINDOWS, progress=False)
    directory = save_quantized_model(pruned, config.quantization_config(), tmp_path / "joint")
    restored = load_model(directory)
    for site, saved in zip(linear_sites(restored), linear_sites(pruned), strict=True):
        if site.path == "lm_head":
            assert not site.is_quantized
            continue
        assert isinstance(site.layer, QuantizedLinear) and site.layer.bits == 4
        matrix = np.asarray(site.layer.dequantized())  # [I, O]
        np.testing.assert_array_equal(matrix, np.asarray(saved.layer.dequantized()))
        zeros = np.sum(matrix.reshape(-1, 4, matrix.shape[1]) == 0, axis=1)  # [I / 4, O]
        assert np.all(zeros >= 2), site.path
    ids = jnp.asarray(WINDOWS[:2])
    np.testing.assert_allclose(restored(ids)[0], pruned(ids)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_a_2_4_result_compresses_into_the_sparse24_format_unchanged(tiny_model, method):
    pruned = prune_model(tiny_model, PruningConfig.for_method(method, pattern=(2, 4)), WINDOWS,
                         progress=False)
    compressed = quantize_model(pruned, QuantizationConfig(method="rtn", rules=(
        QuantizationRule(r"lm_head$", None),
        QuantizationRule(r".", WeightScheme(format="sparse24", bits=32)))))
    for site, source in zip(linear_sites(compressed), linear_sites(pruned), strict=True):
        if site.path != "lm_head":
            assert site.layer.format == "sparse24"
            np.testing.assert_array_equal(site.layer.dequantized(), source.float_matrix())
    ids = jnp.asarray(WINDOWS[:2])
    np.testing.assert_allclose(compressed(ids)[0], pruned(ids)[0], rtol=1e-5, atol=1e-5)
