"""The engine sampler against hand-worked NumPy cases: penalties, bias, min_p, min_tokens,
logprobs, row independence, seeding, and one compiled program for every setting.

Compiling `sample_tokens` costs over a second per shape on these machines, so the tests share
two shapes: hand cases padded to `[B, V]` (tokens past a case's vocabulary get -inf, i.e.
probability 0; rows past its batch are neutral) and `[DRAWS, V]` for the statistical checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.device.sampler import (
    SamplingArrays,
    apply_allowed_bitmask,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    build_sampling_arrays,
    dense_logit_bias,
    filter_for_sampling,
    prompt_logprobs,
    prompt_top_logprobs,
    sample_tokens,
    suppress_stop_tokens,
    unconstrained_bitmask,
)
from jaxinfer.engine.sampling_params import SamplingParams

B, V, K = 6, 8, 4
DRAWS = 8192
PROBABILITIES = [0.5, 0.3, 0.12, 0.08]
LOG_PROBABILITIES = np.log(np.array(PROBABILITIES, np.float32)).tolist()

_sample = jax.jit(sample_tokens, static_argnames="num_logprobs")
_filter = jax.jit(filter_for_sampling)


def _log_softmax(logits) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _logits(rows: list[list[float]], batch: int = B) -> jax.Array:
    """Pads hand-written rows to `[batch, V]`: -inf past a row's tokens, zero rows after."""
    out = np.zeros((batch, V), np.float32)  # [batch, V]
    for index, row in enumerate(rows):
        out[index] = -np.inf
        out[index, :len(row)] = row
    return jnp.asarray(out)


def _arrays(params: list[SamplingParams | None], *, prompts=None, outputs=None, eos=(),
            batch: int = B) -> SamplingArrays:
    rows = len(params)
    return build_sampling_arrays(params, V, prompt_token_ids=prompts or [[]] * rows,
                                 output_token_ids=outputs or [[]] * rows, eos_token_ids=eos,
                                 batch_size=batch)


def _keys(count: int = B, seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed), count)  # [count]


def _kept(filtered, rows: int) -> list[list[int]]:
    return [[int(i) for i in np.flatnonzero(np.isfinite(row))]
            for row in np.asarray(filtered)[:rows]]


# ---------------------------------------------------------------------- penalties and bias


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = jnp.array([[2.0, -1.0, 0.5, -0.5, 3.0]] * 3)  # [3, 5]
    prompt_mask = np.zeros((3, 5), bool)
    prompt_mask[:, 0] = True  # token 0 in the prompt
    counts = np.zeros((3, 5), np.int32)
    counts[:, 1] = 1  # token 1 in the output; tokens 2-4 unseen
    zeros = np.zeros(3, np.float32)
    out = apply_penalties(logits, prompt_mask, counts, zeros, zeros,
                          np.array([2.0, 0.5, 1.0], np.float32))
    np.testing.assert_allclose(out, [[1.0, -2.0, 0.5, -0.5, 3.0],
                                     [4.0, -0.5, 0.5, -0.5, 3.0],  # r < 1 encourages
                                     [2.0, -1.0, 0.5, -0.5, 3.0]])


def test_frequency_and_presence_count_the_output_only():
    logits = jnp.zeros((1, 4))  # [1, 4]
    counts = np.array([[0, 1, 3, 0]], np.int32)
    prompt_mask = np.array([[False, False, False, True]])  # prompt tokens are not penalized
    out = apply_penalties(logits, prompt_mask, counts, np.array([0.25]), np.array([0.5]),
                          np.ones(1))
    # frequency 0.5 * [0, 1, 3, 0] + presence 0.25 * [0, 1, 1, 0]
    np.testing.assert_allclose(out, [[0.0, -0.75, -1.75, 0.0]])


def test_repetition_applies_before_frequency_and_presence():
    out = apply_penalties(jnp.array([[2.0, -1.0]]), np.zeros((1, 2), bool),
                          np.array([[1, 3]], np.int32), np.array([1.0]), np.array([0.5]),
                          np.array([2.0]))
    # token 0: 2 / 2 - 0.5 * 1 - 1 = -0.5; token 1: -1 * 2 - 0.5 * 3 - 1 = -4.5
    np.testing.assert_allclose(out, [[-0.5, -4.5]])


def test_neutral_penalties_and_bias_are_bit_exact():
    logits = jax.random.normal(jax.random.key(3), (2, 7))  # [2, 7]
    neutral = SamplingArrays.neutral(2, 7)
    out = apply_penalties(logits, ~neutral.prompt_mask, neutral.output_counts,
                          neutral.presence, neutral.frequency, neutral.repetition)
    np.testing.assert_array_equal(out, logits)
    np.testing.assert_array_equal(apply_logit_bias(logits, neutral.logit_bias), logits)


def test_dense_logit_bias_rows_and_errors():
    bias = dense_logit_bias([{3: 100.0, 0: -2.5}, None, {}], 5)
    np.testing.assert_array_equal(bias, [[-2.5, 0, 0, 100.0, 0], [0] * 5, [0] * 5])
    assert bias.dtype == np.float32
    with pytest.raises(ValueError, match=r"logit_bias row 1: token id 5 is outside .*\[0, 5\)"):
        dense_logit_bias([None, {5: 1.0}], 5)
    with pytest.raises(ValueError, match="token id -1"):
        dense_logit_bias([{-1: 1.0}], 5)
    with pytest.raises(ValueError, match="bias nan for token id 2"):
        dense_logit_bias([{2: float("nan")}], 5)


def test_logit_bias_forces_a_token_greedy_and_sampled():
    row = np.random.default_rng(1).normal(size=V).tolist()
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=1.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=0.0)]
    tokens, chosen, _, _ = _sample(_logits([row] * 3), _keys(), _arrays(params), num_logprobs=K)
    assert [int(t) for t in tokens[:3]] == [3, 3, int(np.argmax(row))]
    biased = np.array(row)
    biased[3] += 100.0
    np.testing.assert_allclose(chosen[0], _log_softmax(biased)[3], atol=1e-6)


# ---------------------------------------------------------------------- min_p and min_tokens


def test_min_p_threshold_on_a_tiny_vocab():
    logits = jnp.array([LOG_PROBABILITIES] * 4)  # [4, 4]
    # Thresholds: 0.2 * 0.5 = 0.1 keeps 0.5, 0.3, 0.12; 0.7 * 0.5 = 0.35 keeps 0.5 only;
    # 0.239 * 0.5 = 0.1195 still keeps 0.12; min_p 0 keeps everything, unchanged.
    filtered = apply_min_p(logits, np.array([0.0, 0.2, 0.7, 0.239], np.float32))
    assert _kept(filtered, 4) == [[0, 1, 2, 3], [0, 1, 2], [0], [0, 1, 2]]
    np.testing.assert_array_equal(filtered[0], logits[0])


def test_min_p_is_applied_after_temperature():
    # At temperature 2 the probabilities go as sqrt(p): ratios to the top 1, .775, .490, .400,
    # so min_p 0.45 keeps three tokens; at temperature 1 (ratios 1, .6, .24, .16) only two.
    arrays = _arrays([SamplingParams(temperature=2.0, min_p=0.45),
                      SamplingParams(temperature=1.0, min_p=0.45)])
    assert _kept(_filter(_logits([LOG_PROBABILITIES] * 2), arrays), 2) == [[0, 1, 2], [0, 1]]


def test_min_p_composes_with_top_k_and_top_p():
    arrays = _arrays([
        SamplingParams(top_p=0.85),  # mass before each token 0, .5, .8, .92: keeps three
        # min_p 0.2 leaves .5, .3, .12, renormalized to .543, .326, .130: the mass before
        # token 2 is .870 >= .85, so top-p measured after min_p (vLLM's order) keeps two.
        SamplingParams(min_p=0.2, top_p=0.85),
        SamplingParams(min_p=0.2, top_k=3),
        SamplingParams(min_p=0.7, top_k=2),
        SamplingParams(min_p=0.2, top_k=2),
        SamplingParams(min_p=0.0, top_k=0),
    ])
    filtered = _filter(_logits([LOG_PROBABILITIES] * B), arrays)
    assert _kept(filtered, B) == [[0, 1, 2], [0, 1], [0, 1, 2], [0], [0, 1], [0, 1, 2, 3]]


def test_sampled_frequencies_follow_the_min_p_renormalized_distribution():
    arrays = _arrays([SamplingParams(min_p=0.2)] * DRAWS, batch=DRAWS)
    tokens, _, _, _ = _sample(_logits([LOG_PROBABILITIES] * DRAWS, DRAWS), _keys(DRAWS), arrays,
                              num_logprobs=K)
    frequencies = np.bincount(np.asarray(tokens), minlength=V) / DRAWS
    # Standard error ~0.0055 at 8192 draws; the seed is fixed, so this cannot flake.
    np.testing.assert_allclose(frequencies[:4], [0.5 / 0.92, 0.3 / 0.92, 0.12 / 0.92, 0.0],
                               atol=0.02)
    assert frequencies[4:].sum() == 0


def test_suppress_stop_tokens_only_on_flagged_rows():
    logits = jnp.ones((2, 3))  # [2, 3]
    stop_mask = np.array([[False, True, False]] * 2)
    out = suppress_stop_tokens(logits, stop_mask, np.array([True, False]))
    np.testing.assert_array_equal(out, [[1.0, -np.inf, 1.0], [1.0, 1.0, 1.0]])


def test_min_tokens_suppresses_eos_until_reached():
    eos = 2
    row = [1.0, 2.0, 5.0, 3.0]  # EOS is the argmax
    params = [SamplingParams(temperature=0.0, min_tokens=2),  # 1 output: suppressed
              SamplingParams(temperature=0.0, min_tokens=2),  # 2 outputs: free to stop
              SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)]
    arrays = _arrays(params, outputs=[[0], [0, 0], []], eos=[eos])
    np.testing.assert_array_equal(arrays.suppress_stop[:3], [True, False, True])
    tokens, chosen, top_ids, top_values = _sample(_logits([row] * 3), _keys(), arrays,
                                                  num_logprobs=K)
    assert [int(t) for t in tokens[:3]] == [3, eos, eos]
    np.testing.assert_allclose(chosen[0], _log_softmax([1.0, 2.0, -np.inf, 3.0])[3], rtol=1e-6)
    # The suppressed EOS is reported as impossible, after every real token.
    assert int(top_ids[0, -1]) == eos and top_values[0, -1] == -np.inf
    assert int(top_ids[1, 0]) == eos


def test_min_tokens_holds_for_sampled_rows_too():
    # EOS (2) is by far the most likely; eight draws per row over many rows never pick it.
    arrays = _arrays([SamplingParams(min_tokens=5)] * DRAWS, eos=[2], batch=DRAWS)
    tokens, _, _, _ = _sample(_logits([[0.0, 0.0, 4.0]] * DRAWS, DRAWS), _keys(DRAWS), arrays,
                              num_logprobs=K)
    counts = np.bincount(np.asarray(tokens), minlength=V)
    assert counts[2] == 0 and counts[0] > DRAWS // 3 and counts[1] > DRAWS // 3


# ---------------------------------------------------------------------- sample_tokens


def test_neutral_arrays_reproduce_plain_greedy():
    logits = jax.random.normal(jax.random.key(5), (B, V)) * 2  # [B, V]
    tokens, chosen, top_ids, top_values = _sample(logits, _keys(), SamplingArrays.neutral(B, V),
                                                  num_logprobs=K)
    expected = _log_softmax(logits)  # [B, V]
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_allclose(chosen, expected.max(axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-expected, axis=-1)[:, :K])
    np.testing.assert_allclose(top_values, np.sort(expected, axis=-1)[:, ::-1][:, :K],
                               rtol=1e-5)
    assert tokens.dtype == jnp.int32 and top_ids.dtype == jnp.int32


def test_logprobs_are_normalized_taken_after_bias_and_before_temperature():
    logits = _logits([[1.0, 2.0, 3.0, 0.0]] * 2)  # [B, V]; four real tokens
    hot = _arrays([SamplingParams(temperature=0.5, logit_bias={0: 1.5})] * 2)
    tokens, chosen, top_ids, top_values = _sample(logits, _keys(seed=9), hot, num_logprobs=K)
    expected = _log_softmax([2.5, 2.0, 3.0, 0.0])  # bias in, temperature out
    # K = 4 covers every token with nonzero probability, so the top list sums to one.
    np.testing.assert_allclose(np.exp(top_values[:2]).sum(axis=-1), [1.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(top_ids[:2], [[2, 0, 1, 3]] * 2)
    np.testing.assert_allclose(top_values[:2], [np.sort(expected)[::-1]] * 2, rtol=1e-6)
    np.testing.assert_allclose(chosen[:2], expected[np.asarray(tokens[:2])], rtol=1e-6)
    # The same request at temperature 1 reports the same values.
    cool = hot._replace(temperature=np.ones(B, np.float32))
    np.testing.assert_allclose(_sample(logits, _keys(seed=9), cool, num_logprobs=K)[3],
                               top_values)


def test_rows_are_independent():
    logits = jax.random.normal(jax.random.key(2), (B, V)) * 3  # [B, V]
    keys = _keys(seed=4)
    row0 = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05,
                          presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                          logit_bias={4: 2.0}, min_tokens=3)
    first = _arrays([row0, None, SamplingParams(temperature=0.3)], prompts=[[1, 2, 3], [], [5]],
                    outputs=[[4, 4, 7], [], [6]], eos=[0])
    second = _arrays([row0, SamplingParams(temperature=2.0, repetition_penalty=0.5,
                                           logit_bias={7: 50.0}, min_tokens=4),
                      SamplingParams(top_k=1, presence_penalty=-2.0, min_p=0.9),
                      SamplingParams(temperature=1.5, frequency_penalty=2.0)],
                     prompts=[[1, 2, 3], [6, 6], [2], [1]], outputs=[[4, 4, 7], [5], [6, 6], [1]],
                     eos=[0])
    a = _sample(logits, keys, first, num_logprobs=K)
    b = _sample(logits, keys, second, num_logprobs=K)
    assert int(b[0][1]) == 7  # the other rows did change
    for left, right in zip(a, b):
        np.testing.assert_array_equal(left[0], right[0])


def test_same_key_same_token_and_keys_matter():
    arrays = _arrays([SamplingParams(temperature=1.0)] * DRAWS, batch=DRAWS)
    logits = jnp.zeros((DRAWS, V))  # [DRAWS, V]; uniform, so only the key decides
    first = _sample(logits, _keys(DRAWS, 11), arrays, num_logprobs=K)[0]
    np.testing.assert_array_equal(first, _sample(logits, _keys(DRAWS, 11), arrays,
                                                 num_logprobs=K)[0])
    other = _sample(logits, _keys(DRAWS, 12), arrays, num_logprobs=K)[0]
    assert (np.asarray(first) != np.asarray(other)).mean() > 0.8  # 7/8 expected


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = jax.random.normal(jax.random.key(8), (B, V))  # [B, V]
    arrays = _arrays([SamplingParams(temperature=5.0, top_k=1)] * B)
    tokens = _sample(logits, _keys(), arrays, num_logprobs=K)[0]
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))


def test_one_compiled_program_serves_every_setting():
    # A fresh function: jit shares its dispatch cache among wrappers of the same function with
    # the same options, so `jax.jit(sample_tokens, ...)` would also count the other tests' shapes.
    jitted = jax.jit(lambda logits, keys, params: sample_tokens(logits, keys, params, K))
    logits = jax.random.normal(jax.random.key(6), (B, V))  # [B, V]
    keys = _keys()
    greedy = jitted(logits, keys, SamplingArrays.neutral(B, V))
    forced = jitted(logits, keys, _arrays(
        [SamplingParams(temperature=0.7, top_k=4, top_p=0.8, min_p=0.1, logit_bias={5: 80.0},
                        presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=1.5),
         SamplingParams(temperature=0.0, logit_bias={3: 90.0}, min_tokens=2)],
        prompts=[[1], [2]], outputs=[[3, 3], [4]], eos=[0]))
    assert jitted._cache_size() == 1
    np.testing.assert_array_equal(greedy[0], np.argmax(np.asarray(logits), axis=-1))
    assert [int(t) for t in forced[0][:2]] == [5, 3]


# ---------------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_and_top_variant():
    logits = jax.random.normal(jax.random.key(7), (3, 6))  # [3, 6]
    expected = _log_softmax(logits)  # [3, 6]
    next_tokens = jnp.array([1, 0, 5], jnp.int32)  # [3]
    np.testing.assert_allclose(prompt_logprobs(logits, next_tokens),
                               expected[np.arange(3), [1, 0, 5]], rtol=1e-5)
    ids, values = prompt_top_logprobs(logits, 2)
    np.testing.assert_array_equal(ids, np.argsort(-expected, axis=-1)[:, :2])
    np.testing.assert_allclose(values, np.sort(expected, axis=-1)[:, ::-1][:, :2], rtol=1e-5)
    empty_ids, empty_values = prompt_top_logprobs(logits, 0)
    assert empty_ids.shape == (3, 0) and empty_values.shape == (3, 0)


# ---------------------------------------------------------------------- host builder


def test_build_sampling_arrays_fills_rows_and_pads_neutral():
    params = [SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.1,
                             repetition_penalty=1.2, presence_penalty=0.4,
                             frequency_penalty=-0.3, logit_bias={1: -3.0}, min_tokens=4,
                             stop_token_ids=[4]),
              None]
    arrays = build_sampling_arrays(params, 6, prompt_token_ids=[[0, 2, 2], [5]],
                                   output_token_ids=[[1, 1, 3], []], eos_token_ids=[5],
                                   batch_size=3)
    np.testing.assert_allclose(arrays.temperature, [0.7, 0.0, 0.0])
    np.testing.assert_array_equal(arrays.top_k, [0, 0, 0])
    np.testing.assert_allclose(arrays.top_p, [0.9, 1.0, 1.0])
    np.testing.assert_allclose(arrays.min_p, [0.1, 0.0, 0.0])
    np.testing.assert_allclose(arrays.repetition, [1.2, 1.0, 1.0])
    np.testing.assert_allclose(arrays.presence, [0.4, 0.0, 0.0])
    np.testing.assert_allclose(arrays.frequency, [-0.3, 0.0, 0.0])
    np.testing.assert_array_equal(arrays.logit_bias[:, 1], [-3.0, 0.0, 0.0])
    # Row 1 has no penalty, so its prompt is not even counted (the result is the same).
    np.testing.assert_array_equal(arrays.prompt_mask, [[1, 0, 1, 0, 0, 0], [0] * 6, [0] * 6])
    np.testing.assert_array_equal(arrays.output_counts, [[0, 2, 0, 1, 0, 0], [0] * 6, [0] * 6])
    np.testing.assert_array_equal(arrays.stop_mask[0], [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(arrays.suppress_stop, [True, False, False])
    neutral = SamplingArrays.neutral(3, 6)
    for built, reference in zip(arrays, neutral):
        assert type(built) is type(reference)
        assert built.dtype == reference.dtype and built.shape == reference.shape


def test_vocabulary_rows_no_request_uses_are_shared_read_only_constants():
    def build():
        return build_sampling_arrays([SamplingParams(temperature=0.5, top_p=0.9), None], 6,
                                     prompt_token_ids=[[0, 1], [2]],
                                     output_token_ids=[[3], []], eos_token_ids=[5],
                                     batch_size=4)

    first, second = build(), build()
    neutral = SamplingArrays.neutral(4, 6)
    for name in ("logit_bias", "prompt_mask", "output_counts", "stop_mask", "allowed"):
        built = getattr(first, name)
        np.testing.assert_array_equal(built, getattr(neutral, name))
        assert built.dtype == getattr(neutral, name).dtype
        assert built is getattr(second, name) and not built.flags.writeable
    # A feature one row uses gets fresh rows, the others stay neutral.
    biased = build_sampling_arrays([SamplingParams(logit_bias={2: 1.5}), None], 6,
                                   prompt_token_ids=[[0], [1]], output_token_ids=[[], []],
                                   batch_size=4)
    np.testing.assert_array_equal(biased.logit_bias[:, 2], [1.5, 0.0, 0.0, 0.0])
    assert biased.logit_bias.flags.writeable
    assert biased.logit_bias is not first.logit_bias
    assert not first.logit_bias.any()


def test_build_sampling_arrays_errors():
    with pytest.raises(ValueError, match="output_token_ids row 0: token id 6"):
        build_sampling_arrays([SamplingParams(frequency_penalty=0.5)], 6,
                              prompt_token_ids=[[]], output_token_ids=[[6]])
    with pytest.raises(ValueError, match="must match"):
        build_sampling_arrays([None, None], 6, prompt_token_ids=[[]], output_token_ids=[[]])
    with pytest.raises(ValueError, match="not exceed the batch"):
        build_sampling_arrays([None], 6, prompt_token_ids=[[]], output_token_ids=[[]],
                              batch_size=0)


# ---------------------------------------------------------------------- structured output


def _bitmask(allowed_rows: list[list[int]], vocab: int, batch: int) -> np.ndarray:
    """`[batch, ceil(vocab / 32)]` packed rows allowing the given ids (rows past the list:
    every token)."""
    bitmask = unconstrained_bitmask(batch, vocab)
    for row, ids in enumerate(allowed_rows):
        bits = np.zeros(bitmask.shape[1] * 32, np.bool_)
        bits[ids] = True
        bitmask[row] = np.packbits(bits, bitorder="little").view(np.int32)
    return bitmask


def test_allowed_bitmask_equals_llguidances_own_numpy_reference():
    # 70 tokens: three words, the last one partly past the vocabulary; bit 31 (the sign bit
    # of an int32 word) is allowed in row 0.
    from llguidance.numpy import apply_token_bitmask_inplace
    vocab, rng = 70, np.random.default_rng(3)
    logits = rng.normal(size=(4, vocab)).astype(np.float32)  # [4, 70]
    bitmask = rng.integers(-2**31, 2**31, size=(4, 3), dtype=np.int64).astype(np.int32)
    bitmask[0, 0] |= np.int32(-2**31)
    bitmask[3] = -1  # an unconstrained row
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, bitmask)
    masked = np.asarray(jax.jit(apply_allowed_bitmask)(logits, bitmask))
    np.testing.assert_array_equal(masked, expected)
    assert np.isfinite(masked[0, 31])
    np.testing.assert_array_equal(masked[3], logits[3])  # all ones: bit-identical


def test_constrained_and_unconstrained_rows_share_a_batch():
    logits = jax.random.normal(jax.random.key(11), (B, V))  # [B, V]
    free = np.argmax(np.asarray(logits), axis=-1)
    allowed = [[2, 5], [int(free[1])], [0, 1, 3]]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=4)] + [SamplingParams(temperature=0.0)] * 3
    arrays = build_sampling_arrays(params, V, prompt_token_ids=[[]] * B,
                                   output_token_ids=[[]] * B,
                                   allowed=_bitmask(allowed, V, 3))  # rows 3.. unconstrained
    tokens, chosen, _, _ = _sample(logits, _keys(), arrays, num_logprobs=K)
    tokens = np.asarray(tokens)
    assert tokens[0] == [2, 5][int(np.argmax(np.asarray(logits)[0, [2, 5]]))]
    assert tokens[1] == free[1]  # an allowed argmax is kept
    assert tokens[2] in allowed[2]
    np.testing.assert_array_equal(tokens[3:], free[3:])
    # Logprobs are those of the masked distribution (they sum to 1 over the allowed tokens).
    reference = _log_softmax(np.asarray(logits)[0, [2, 5]])
    np.testing.assert_allclose(chosen[0], reference.max(), rtol=1e-5)
    # A sampled constrained row never leaves its allowed set (uniform logits: without the
    # mask, 20 draws would leave it with probability 1 - (3/8)^20).
    draws = {int(_sample(jnp.zeros((B, V)), jax.random.split(jax.random.key(seed), B),
                         arrays, num_logprobs=K)[0][2]) for seed in range(20)}
    assert draws <= set(allowed[2])


def test_sampling_arrays_reject_a_bitmask_of_the_wrong_width():
    with pytest.raises(ValueError, match="bitmask words"):
        build_sampling_arrays([None], V, prompt_token_ids=[[]], output_token_ids=[[]],
                              allowed=np.zeros((1, 2), np.int32))
