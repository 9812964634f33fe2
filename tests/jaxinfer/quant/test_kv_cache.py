"""The 8-bit KV caches (int8, fp8 e4m3, fp8 e5m2): their rounding by hand, their bytes, and the
engine with each cache against the reference `generate` with the same rounding applied to its
contiguous cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
from jaxinfer.models import PagedBatch, PagedKVCache, create_model
from jaxinfer.models.hooks import ActivationHooks, with_activation_hooks
from jaxinfer.perplexity import perplexity
from jaxinfer.quant.kv_cache import int8_round_trip, kv_bytes_per_token, scaled_round_trip


def test_round_trip_by_hand():
    x = jnp.asarray([[[[1.27, -0.5, 0.0, 0.004], [0.0, 0.0, 0.0, 0.0]]]])  # [1, 1, 2, 4]
    # Head 0: scale 1.27 / 127 = 0.01; 0.004 rounds to 0. Head 1 is all zeros.
    np.testing.assert_allclose(int8_round_trip(x)[0, 0, 0], [1.27, -0.5, 0.0, 0.0], atol=1e-7)
    np.testing.assert_array_equal(int8_round_trip(x)[0, 0, 1], 0.0)
    y = jax.random.normal(jax.random.key(0), (2, 3, 2, 16))  # [B, T, K, H]
    step = jnp.max(jnp.abs(y), axis=-1, keepdims=True) / 127
    assert bool(jnp.all(jnp.abs(int8_round_trip(y) - y) <= step * (0.5 + 1e-5)))


def test_bytes_per_token_and_the_int8_pool():
    config = get_preset("tiny")  # 2 layers, 2 kv heads of 16
    assert kv_bytes_per_token(config) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(config, "bfloat16") == 2 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(config, "int8") == 2 * 2 * 2 * 16 + 4 * 2 * 2 * 2
    empty = PagedBatch(*(jnp.zeros((1,), jnp.int32) for _ in range(5)))
    pool = PagedKVCache.create(config, 5, 16, empty, dtype="int8")
    # [L, P, Z, 2K, H] pages, [L, P, Z, 2K] scales
    assert pool.pages.dtype == jnp.int8 and pool.pages.shape == (2, 5, 16, 4, 16)
    assert pool.scales.dtype == jnp.float32 and pool.scales.shape == (2, 5, 16, 4)
    assert PagedKVCache.create(config, 5, 16, empty).scales is None
    for name, dtype in (("fp8_e4m3", jnp.float8_e4m3fn), ("fp8_e5m2", jnp.float8_e5m2)):
        assert kv_bytes_per_token(config, name) == kv_bytes_per_token(config, "int8")
        pool = PagedKVCache.create(config, 5, 16, empty, dtype=name)
        assert pool.pages.dtype == dtype and pool.scales.shape == (2, 5, 16, 4)


def test_fp8_round_trip_by_hand():
    x = jnp.asarray([[[[448.0, 100.0, -0.3, 0.0]]]])  # [1, 1, 1, 4]; scale 448 / 448 = 1
    np.testing.assert_array_equal(scaled_round_trip("fp8_e4m3")(x)[0, 0, 0],
                                  [448.0, 96.0, -0.3125, 0.0])
    # e5m2 keeps 2 mantissa bits: scale 448 / 57344 = 2^-7, 100 * 2^7 = 12800 -> 12288.
    np.testing.assert_array_equal(scaled_round_trip("fp8_e5m2")(x)[0, 0, 0],
                                  [448.0, 96.0, -0.3125, 0.0])
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'"):
        scaled_round_trip("int4")


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_engine_with_an_8bit_cache_equals_reference_generate_with_its_rounding(
        model, kv_cache_dtype):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=length).tolist() for length in (2, 9, 33, 70)]
    # The hooks are part of the rounded copy's graph: its programs are its own.
    rounded = with_activation_hooks(
        model, ActivationHooks(keys_values=scaled_round_trip(kv_cache_dtype)))
    expected = generate(rounded, prompts, max_new_tokens=6, eos_token_ids=())
    engine = Engine(model, EngineConfig.from_options(page_size=16, max_num_batched_tokens=32,
                                        max_num_seqs=4, max_model_len=128, bucket_growth=4,
                                        kv_cache_dtype=kv_cache_dtype))
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt,
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    assert [outputs[str(index)] for index in range(len(prompts))] == expected
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_options(kv_cache_dtype="int3")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_8bit_cache_perplexity_equals_the_simulated_rounding(model, kv_cache_dtype):
    ids = np.random.default_rng(1).integers(3, 512, size=90)  # [N]
    paged = perplexity(model, ids, window=32, batch_size=2, kv_cache_dtype=kv_cache_dtype)
    rounded = with_activation_hooks(
        model, ActivationHooks(keys_values=scaled_round_trip(kv_cache_dtype)))
    simulated = perplexity(rounded, ids, window=32, batch_size=2)
    exact = perplexity(model, ids, window=32, batch_size=2)
    assert paged.tokens == simulated.tokens == exact.tokens
    assert paged.nll == pytest.approx(simulated.nll, rel=1e-5)
    assert paged.nll != exact.nll  # the cache did round something


def test_harp_layers_take_no_cache_bytes():
    config = get_preset("tiny").replace(num_layers=4, harp_alphas=(1.0,))  # 3 cached layers
    dense = config.replace(harp_alphas=())
    assert kv_bytes_per_token(config, "int8") == 3 * (2 * 2 * 16 + 4 * 2 * 2)
    assert kv_bytes_per_token(config) == kv_bytes_per_token(dense) * 3 // 4
