"""HARP blocks (`ModelConfig.harp_alphas`): the block against a numpy reference of
h + alpha W_o W_v norm(h) followed by the unchanged MLP, alpha = 0 skipping the attention
sub-block, no q/k parameters, caches holding only the blocks below, and the scanning copy."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import ConfigError, get_preset
from jaxinfer.models import KVCache, PagedBatch, PagedKVCache, Transformer
from jaxinfer.models.harp_attention import HarpAttention
from jaxinfer.models.scan import can_stack_layers, stack_layers

# 4 heads over 2 KV heads (groups of 2), attention biases on, so the reference checks the
# head grouping and the value bias; the top two of four blocks are HARP blocks.
CONFIG = get_preset("tiny").replace(num_layers=4, attention_bias=True,
                                    harp_alphas=(0.3, 1.0))


@pytest.fixture(scope="module")
def model():
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    # Non-zero biases and gains, so that a wrong grouping or a skipped term shows.
    rng = np.random.default_rng(0)
    for block in model.layers:
        block.attention.v_bias[...] = rng.normal(size=block.attention.v_bias.shape) * 0.1
        block.input_norm.weight[...] = 1.0 + rng.normal(size=(CONFIG.hidden_size,)) * 0.1
    return model


def _rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain  # [B, T, D]


def _reference_harp_attention(block, x: np.ndarray, alpha: float) -> np.ndarray:
    """h + alpha W_o W_v norm(h), written out head by head in float64."""
    attention = block.attention
    normed = _rms_norm(x, np.asarray(block.input_norm.weight[...], np.float64),
                       CONFIG.rms_norm_eps)  # [B, T, D]
    v_weight = np.asarray(attention.v_proj[...], np.float64)  # [D, K, H]
    o_weight = np.asarray(attention.o_proj[...], np.float64)  # [N, H, D]
    v_bias = np.asarray(attention.v_bias[...], np.float64)  # [K, H]
    out = np.zeros_like(x)  # [B, T, D]
    for head in range(CONFIG.num_heads):
        kv_head = head // CONFIG.group_size
        value = normed @ v_weight[:, kv_head] + v_bias[kv_head]  # [B, T, H]
        out += value @ o_weight[head]  # [B, T, D]
    return x + alpha * out


def test_harp_blocks_have_no_query_or_key_parameters(model):
    kinds = [type(block.attention) for block in model.layers]
    assert kinds[:2] == [type(model.layers[0].attention)] * 2
    assert kinds[2:] == [HarpAttention, HarpAttention]
    names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model))}
    for layer in (2, 3):
        assert not any(name.startswith(f"layers.{layer}.attention.{projection}")
                       for name in names for projection in ("q_", "k_"))
        assert f"layers.{layer}.attention.v_proj" in names
        assert f"layers.{layer}.attention.o_proj" in names
    assert "layers.1.attention.q_proj" in names
    assert [model.layers[i].attention.alpha for i in (2, 3)] == [0.3, 1.0]


@pytest.mark.parametrize("layer", [2, 3])
def test_harp_block_equals_the_reference(model, layer):
    block = model.layers[layer]
    x = np.random.default_rng(layer).normal(size=(2, 5, CONFIG.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(5, dtype=np.int32), (2, 5))  # [B, T]
    out, cache = block(x, positions, None)  # [B, T, D]
    assert cache is None
    after_attention = _reference_harp_attention(block, x.astype(np.float64),
                                                CONFIG.harp_alphas[layer - 2])  # [B, T, D]
    expected = np.asarray(block.feed_forward(after_attention.astype(np.float32)))  # [B, T, D]
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    # The attention part alone, against the reference, without the MLP in between.
    attended = x + np.asarray(block.attention(block.input_norm(x)))  # [B, T, D]
    np.testing.assert_allclose(attended, after_attention, rtol=1e-4, atol=1e-5)


def test_alpha_zero_skips_the_attention_sub_block(model):
    zero = Transformer(CONFIG.replace(harp_alphas=(0.0, 1.0)), rngs=nnx.Rngs(0))
    nnx.update(zero, nnx.state(model))
    block = zero.layers[2]
    x = np.random.default_rng(3).normal(size=(1, 4, CONFIG.hidden_size)).astype(np.float32)
    positions = np.arange(4, dtype=np.int32)[None]  # [1, T]
    out, _ = block(x, positions, None)  # [B, T, D]
    np.testing.assert_array_equal(out, block.feed_forward(x))  # exactly h + mlp(norm(h))


def test_caches_hold_only_the_blocks_below_and_logits_match(model):
    assert CONFIG.num_cache_layers == 2 and CONFIG.num_harp_layers == 2
    assert [CONFIG.harp_alpha(i) for i in range(4)] == [None, None, 0.3, 1.0]
    cache = KVCache.create(CONFIG, 2, 16)
    assert len(cache.layers) == 2
    empty = PagedBatch(*(np.zeros((1,), np.int32) for _ in range(5)))
    pool = PagedKVCache.create(CONFIG, 5, 8, empty, dtype="int8")
    assert pool.pages.shape == (2, 5, 8, 2 * CONFIG.num_kv_heads, CONFIG.head_dim)
    assert pool.scales.shape == (2, 5, 8, 2 * CONFIG.num_kv_heads)
    ids = np.random.default_rng(1).integers(3, 512, size=(2, 6)).astype(np.int32)  # [B, T]
    no_cache, _ = model(ids)  # [B, T, V]
    with_cache, cache = model(ids, None, cache)  # [B, T, V]
    np.testing.assert_allclose(with_cache, no_cache, rtol=1e-5, atol=1e-5)
    assert len(cache.layers) == 2 and float(np.abs(cache.layers[1].keys).sum()) > 0


def test_scanning_copy_stacks_the_cached_blocks_and_keeps_the_harp_ones(model):
    plain = Transformer(CONFIG.replace(attention_bias=False), rngs=nnx.Rngs(1))
    assert can_stack_layers(plain)
    stacked = stack_layers(plain)
    assert len(stacked.layers) == 2
    assert all(isinstance(block.attention, HarpAttention) for block in stacked.layers)
    assert stacked.stacked_layers.attention.q_proj[...].shape[0] == 2  # [L, D, N, H]
    ids = np.random.default_rng(2).integers(3, 512, size=(2, 7)).astype(np.int32)  # [B, T]
    np.testing.assert_allclose(stacked(ids)[0], plain(ids)[0], rtol=1e-5, atol=1e-5)


def test_config_checks_and_round_trips_harp_alphas():
    with pytest.raises(ConfigError, match="harp_alphas"):
        CONFIG.replace(harp_alphas=(1.0,) * 4)  # the bottom block must keep its cache
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        CONFIG.replace(harp_alphas=(1.5,))
    hf = CONFIG.to_hf()
    assert hf["jaxinfer_harp"] == {"layers": [2, 3], "alphas": [0.3, 1.0]}
    assert type(CONFIG).from_hf(hf).harp_alphas == (0.3, 1.0)
    assert type(CONFIG).from_dict(CONFIG.to_dict()) == CONFIG
    with pytest.raises(ConfigError, match=r"jaxinfer_harp\.layers"):
        type(CONFIG).from_hf({**hf, "jaxinfer_harp": {"layers": [1, 2], "alphas": [1, 1]}})
    assert "jaxinfer_harp" not in get_preset("tiny").to_hf()
