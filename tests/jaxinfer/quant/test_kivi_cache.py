"""KIVI int4 / int2 KV caches in the engine: the round trip for whole sequences, bytes per token,
perplexity through the paged path against the simulated rounding, and the engine's greedy
output (against the rounding's prefill, across chunkings, with prefix caching, and with its
residual seats given back).

What is compared: a KIVI pool's rounding depends on when a page fills, so the reference
`generate` (which rounds each new token as it comes) has no exact twin. The engine's first
token (a whole-prompt prefill) must equal the cache-free forward with `kivi_round_trip`;
all tokens must not depend on the batch (each request alone, in a seat another request had
used) nor on a prefix-cache hit. (Prefill chunks that end inside a page do change the
rounding a query sees, as decoding does: its page is exact until it fills.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.config import SchedulerConfigError
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.kv_formats import kivi_residual_bytes
from jaxinfer.models import PagedBatch, PagedKVCache, create_model
from jaxinfer.models.hooks import ActivationHooks, with_activation_hooks
from jaxinfer.perplexity import perplexity
from jaxinfer.quant.kv_cache import kivi_round_trip, kv_bytes_per_token


@pytest.mark.parametrize("bits_name", ["int4", "int2"])
def test_round_trip_keeps_the_residual_exact_and_rounds_the_rest(bits_name):
    keys = jax.random.normal(jax.random.key(0), (2, 21, 2, 16))  # [B, T, K, H]
    values = jax.random.normal(jax.random.key(1), (2, 21, 2, 16))
    levels = 2 ** {"int4": 4, "int2": 2}[bits_name] - 1
    # Pages of 8 over 21 tokens: the default residual (a page) and 16 keep 21 % 8 = 21 % 16
    # = 5 tokens exact, 0 keeps none, 24 keeps all 21.
    for residual, exact_from in ((None, 16), (0, 21), (16, 16), (24, 0)):
        got_keys, got_values = kivi_round_trip(bits_name, page_size=8, residual=residual)(
            keys, values)
        for got, original in ((got_keys, keys), (got_values, values)):
            got, original = np.asarray(got), np.asarray(original)
            np.testing.assert_array_equal(got[:, exact_from:], original[:, exact_from:])
            error = np.abs(got[:, :exact_from] - original[:, :exact_from])
            assert exact_from == 0 or error.max() > 0
            # Half a step of a group whose range is below 8 (normal draws), plus float16.
            assert error.max(initial=0) <= 8 / levels / 2 + 1e-2
    with pytest.raises(ValueError, match="residual 12"):
        kivi_round_trip("int4", page_size=8, residual=12)
    with pytest.raises(ValueError, match="'fp8_e4m3'"):
        kivi_round_trip("fp8_e4m3")


def test_bytes_per_token_and_the_kivi_pool():
    config = get_preset("tiny")  # 2 layers, 2 kv heads of 16: value groups of 16
    # int4: 8 + 8 bytes of codes, key scale + zero (f16) per channel over 16 tokens (4 bytes),
    # value scale + zero per token (4 bytes) = 24 per head and layer.
    assert kv_bytes_per_token(config, "int4") == 2 * 2 * 24
    assert kv_bytes_per_token(config, "int2") == 2 * 2 * 16
    assert kv_bytes_per_token(config, "int4", page_size=32) == 2 * 2 * 22
    empty = PagedBatch(*(jnp.zeros((1,), jnp.int32) for _ in range(5)))
    pool = PagedKVCache.create(config, 5, 16, empty, dtype="int2", num_residual=3)
    assert pool.pages.dtype == jnp.uint8 and pool.pages.shape == (2, 5, 16, 4, 4)
    assert pool.scales.key_scales.shape == (2, 5, 2, 16)
    assert pool.scales.value_zeros.shape == (2, 5, 16, 2, 1)
    assert pool.scales.residual.shape == (2, 3, 16, 4, 16)
    assert pool.scales.residual.nbytes == kivi_residual_bytes(2, 2, 16, 16, 3)


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


@pytest.mark.parametrize("kv_cache_dtype", ["int4", "int2"])
def test_kivi_perplexity_equals_the_simulated_rounding(model, kv_cache_dtype):
    ids = np.random.default_rng(1).integers(3, 512, size=90)  # [N]; windows of 40 = 2.5 pages
    paged = perplexity(model, ids, window=40, batch_size=2, kv_cache_dtype=kv_cache_dtype)
    rounded = with_activation_hooks(
        model, ActivationHooks(key_value_pair=kivi_round_trip(kv_cache_dtype, page_size=16)))
    simulated = perplexity(rounded, ids, window=40, batch_size=2)
    exact = perplexity(model, ids, window=40, batch_size=2)
    assert paged.tokens == simulated.tokens == exact.tokens
    assert paged.nll == pytest.approx(simulated.nll, rel=1e-5)
    assert paged.nll != exact.nll


def _run(engine, prompts, ids=None):
    ids = ids or [str(index) for index in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt,
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    return [outputs[request_id] for request_id in ids]


def _engine(model, kv_cache_dtype, budget, prefix_caching=True):
    return Engine(model, EngineConfig.from_options(
        page_size=16, max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=128,
        bucket_growth=4, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=prefix_caching))


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int4", "int2"])
def test_engine_greedy_with_a_kivi_cache(model, kv_cache_dtype):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=length).tolist() for length in (2, 9, 33, 70)]
    rounded = with_activation_hooks(
        model, ActivationHooks(key_value_pair=kivi_round_trip(kv_cache_dtype, page_size=16)))
    first = [int(jnp.argmax(rounded(jnp.asarray([prompt]))[0][0, -1])) for prompt in prompts]
    # A budget of 128 prefills all four prompts in one step: each page of a prompt is
    # rounded in that step, as the cache-free forward with the round trip rounds it.
    engine = _engine(model, kv_cache_dtype, budget=128)
    batched = _run(engine, prompts)
    assert [tokens[0] for tokens in batched] == first
    # One request at a time (each reusing a seat another had) gives the same tokens.
    assert [_run(engine, [prompt], [f"alone{index}"])[0]
            for index, prompt in enumerate(prompts)] == batched
    # Every residual seat is back; an aborted request gives its seat back too.
    assert sorted(engine.runner._free_seats) == [0, 1, 2, 3]
    engine.add_request("gone", prompts[3], SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    engine.abort_request("gone")
    assert sorted(engine.runner._free_seats) == [0, 1, 2, 3]
    # Prefix caching shares the quantized full pages: a prompt extending a finished one
    # (its 64-token prefix cached) gives what it gives without the cache.
    extended = [prompts[3][:64] + rng.integers(3, 512, size=10).tolist()]
    hits_before = engine.stats().prefix_cache_hits
    assert _run(engine, extended, ["again"]) == _run(
        _engine(model, kv_cache_dtype, budget=128, prefix_caching=False), extended)
    assert engine.stats().prefix_cache_hits - hits_before == 64


def test_kivi_takes_no_speculative_decoding():
    with pytest.raises(SchedulerConfigError, match="'kv_cache_dtype' = 'int4'"):
        EngineConfig.from_options(kv_cache_dtype="int4",
                                  speculative={"method": "ngram", "num_tokens": 2})
