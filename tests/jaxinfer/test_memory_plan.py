"""Memory arithmetic against published parameter counts, our own models' parameters, and a
hand-worked plan."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from jaxinfer.config import get_preset
from jaxinfer.memory_plan import (
    ACCELERATORS,
    GIB,
    kv_bytes_per_token,
    parameter_count,
    plan,
    weight_bytes,
)
from jaxinfer.models import create_model


@pytest.mark.parametrize(("preset", "published"), [
    ("llama-2-7b", 6_738_415_616), ("llama-2-70b", 68_976_648_192),
    ("llama-3-8b", 8_030_261_248),
    ("mistral-7b", 7_241_732_096), ("mixtral-8x7b", 46_702_792_704)])
def test_parameter_counts_match_the_published_ones(preset, published):
    assert parameter_count(get_preset(preset)) == published


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_parameter_count_matches_our_model(preset):
    model = create_model(get_preset(preset), seed=0)
    params = nnx.state(model, nnx.Param)
    assert parameter_count(get_preset(preset)) == sum(
        leaf.size for leaf in jax.tree.leaves(params))


def test_kv_bytes_by_hand():
    config = get_preset("llama-2-7b")  # 32 layers, 32 KV heads of 128
    assert kv_bytes_per_token(config) == 32 * 2 * 32 * 128 * 2  # 512 KiB
    assert kv_bytes_per_token(config, tensor_parallel=8) == 32 * 2 * 4 * 128 * 2
    assert kv_bytes_per_token(config, "int8") == 32 * 2 * 32 * (128 + 4)
    assert kv_bytes_per_token(config, "fp8_e4m3") == kv_bytes_per_token(config, "fp8_e5m2") \
        == kv_bytes_per_token(config, "int8")
    # KIVI per head and layer: codes 2 * 128 * b / 8, key scale + zero (f16) per channel over
    # a page of 16 (2 * 128 * 2 / 16 = 32), value scale + zero per token and 32 channels (16).
    assert kv_bytes_per_token(config, "int4") == 32 * 32 * (128 + 32 + 16)
    assert kv_bytes_per_token(config, "int2") == 32 * 32 * (64 + 32 + 16)
    assert kv_bytes_per_token(config, "int2", page_size=64) == 32 * 32 * (64 + 8 + 16)
    with pytest.raises(ValueError, match="int3"):
        kv_bytes_per_token(config, "int3")
    mistral = get_preset("mistral-7b")  # 8 KV heads: past 8 chips each keeps one head
    assert kv_bytes_per_token(mistral, tensor_parallel=16) == kv_bytes_per_token(
        mistral, tensor_parallel=8)


def test_weight_formats_shrink_the_block_linears_only():
    config = get_preset("llama-2-7b")
    bf16, int8, int4 = (weight_bytes(config, name) for name in ("bf16", "int8", "int4"))
    embeddings = 2 * 2 * 32000 * 4096
    assert bf16 == 2 * parameter_count(config)
    # int8: half the linear bytes plus a 4-byte scale per output channel.
    assert 0.5 < (int8 - embeddings) / (bf16 - embeddings) < 0.501
    # int4 g128: a quarter plus (4 + 1) bytes per 128 rows per column.
    assert (int4 - embeddings) / (bf16 - embeddings) == pytest.approx(0.25 + 5 / 256, rel=1e-3)
    with pytest.raises(ValueError, match="unknown weight format 'fp8'"):
        weight_bytes(config, "fp8")


def test_plan_by_hand_and_its_errors():
    config = get_preset("llama-2-7b")
    result = plan(config, ACCELERATORS["v5e-8"])  # 16 GiB chips, tp 8
    assert result.weights_per_chip == -(-2 * 6_738_415_616 // 8)
    assert result.reserved_per_chip == int(0.1 * 16 * GIB)
    assert result.kv_budget_per_chip == (16 * GIB - result.reserved_per_chip
                                         - result.weights_per_chip)
    assert result.max_context_tokens == result.kv_budget_per_chip // (32 * 2 * 4 * 128 * 2)
    assert result.fits
    assert not plan(get_preset("mixtral-8x7b"), ACCELERATORS["v5e-8"], tensor_parallel=1).fits
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide the 8 chips"):
        plan(config, ACCELERATORS["v5e-8"], tensor_parallel=3)


def test_harp_layers_have_no_kv_bytes_and_no_query_key_weights():
    dense = get_preset("llama-3-8b")  # 32 layers, 8 KV heads of 128
    harp = dense.replace(harp_alphas=(1.0, 0.5, 0.0))  # the top 3 layers
    assert kv_bytes_per_token(harp) == 29 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(harp, "int8", 4) == kv_bytes_per_token(dense, "int8", 4) * 29 // 32
    query_key = 3 * 4096 * (32 + 8) * 128  # q [D, N*H] and k [D, K*H] of 3 layers
    assert parameter_count(dense) - parameter_count(harp) == query_key
    assert weight_bytes(dense) - weight_bytes(harp) == 2 * query_key
    tiny = get_preset("tiny").replace(num_layers=4, attention_bias=True, harp_alphas=(0.5,))
    params = nnx.state(create_model(tiny, seed=0), nnx.Param)
    assert parameter_count(tiny) == sum(leaf.size for leaf in jax.tree.leaves(params))
