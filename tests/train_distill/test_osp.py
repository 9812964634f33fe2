"""OSP's architecture parts: SSNorm and EmbProj fold into a plain Llama with the same logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from checkpoints import save_hf_checkpoint
from jaxinfer.config import ConfigError, get_preset
from jaxinfer.models import create_model
from tests.tiny_hf import hf_logits
from train_distill.osp import fold_osp

OSP_VARIANTS = [
    dict(norm_type="single_scale"),
    dict(embedding_projection=True),
    dict(norm_type="single_scale", embedding_projection=True),
    dict(norm_type="single_scale", embedding_projection=True, tie_word_embeddings=True),
]


def _trained_looking_osp_model(**osp):
    """An OSP model whose scalar gains are not 1, so folding them is not a no-op."""
    model = create_model(get_preset("tiny").replace(**osp), seed=3)
    gains = iter(np.linspace(0.5, 1.8, 2 * len(model.layers) + 1))
    for block in model.layers:
        for norm in (block.input_norm, block.post_attention_norm):
            norm.weight[...] = jnp.full(norm.weight.shape, next(gains), jnp.float32)
    model.final_norm.weight[...] = jnp.full(model.final_norm.weight.shape, next(gains))
    return model


def test_single_scale_norm_has_one_gain_and_projections_are_orthogonal():
    model = create_model(get_preset("tiny").replace(norm_type="single_scale",
                                                    embedding_projection=True))
    assert model.final_norm.weight.shape == (1,)
    assert all(block.input_norm.weight.shape == (1,) for block in model.layers)
    projection = np.asarray(model.input_projection[...])  # [D, D]
    np.testing.assert_allclose(projection @ projection.T, np.eye(projection.shape[0]),
                               atol=1e-5)


@pytest.mark.parametrize("osp", OSP_VARIANTS, ids=lambda osp: "+".join(osp))
def test_fold_preserves_logits(osp):
    model = _trained_looking_osp_model(**osp)
    tokens = jax.random.randint(jax.random.key(0), (2, 11), 0, model.config.vocab_size)
    folded = fold_osp(model)
    assert not folded.config.uses_osp_parts
    assert folded.final_norm.weight.shape == (model.config.hidden_size,)
    reference, _ = model(tokens)  # [B, T, V]
    ours, _ = folded(tokens)  # [B, T, V]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), atol=1e-5, rtol=0)
    if osp.get("embedding_projection"):
        assert not hasattr(folded, "input_projection") or folded.input_projection is None


def test_folded_export_loads_in_transformers_with_the_same_logits(tmp_path):
    model = _trained_looking_osp_model(norm_type="single_scale", embedding_projection=True)
    prompts = [[1, 17, 33, 200, 5, 9], [1, 400, 2, 88]]
    width = max(map(len, prompts))
    padded = jnp.asarray([prompt + [0] * (width - len(prompt)) for prompt in prompts])
    reference, _ = model(padded)  # [B, T, V]
    directory = save_hf_checkpoint(fold_osp(model), tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                                 dtype="float32").eval()
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    theirs = hf_logits(hf_model, prompts)  # [B, T, V]
    for row, prompt in enumerate(prompts):
        np.testing.assert_allclose(theirs[row, :len(prompt)],
                                   np.asarray(reference)[row, :len(prompt)], atol=1e-5, rtol=0)


def test_unfolded_osp_model_refuses_hf_export(tmp_path):
    model = create_model(get_preset("tiny").replace(norm_type="single_scale"))
    with pytest.raises(ConfigError, match=r"norm_type.*fold"):
        save_hf_checkpoint(model, tmp_path / "hf")


def test_fold_leaves_plain_models_alone():
    model = create_model(get_preset("tiny"))
    assert fold_osp(model) is model
    state = nnx.state(fold_osp(_trained_looking_osp_model(norm_type="single_scale")))
    assert "input_projection" not in state or state["input_projection"] is None
