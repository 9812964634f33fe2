"""Exact speculative sampling: chi-square tests of the emitted tokens against the target, a
deliberately wrong verifier that must fail them, point-mass drafts, the sampler's transform on
both sides, and greedy rows against a slow Python reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer.engine.device.sampler import SamplingArrays
from jaxinfer.engine.spec.verify import (
    Verification,
    acceptance_mask,
    first_rejection,
    sampling_probabilities,
    verify,
)

VOCAB = 8
NUM_DRAFTS = 3
TRIALS = 100_000


def _params(rows: int, temperature: float = 1.0, top_k: int = 0) -> SamplingArrays:
    neutral = SamplingArrays.neutral(rows, VOCAB)
    return neutral._replace(temperature=np.full((rows,), temperature, np.float32),
                            top_k=np.full((rows,), top_k, np.int32))


def _distributions(seed: int, positions: int) -> np.ndarray:
    """`[positions, V]` distinct, uneven distributions (some tokens rare)."""
    rng = np.random.default_rng(seed)
    weights = rng.gamma(0.7, size=(positions, VOCAB)) + 0.01  # [P, V]
    return weights / weights.sum(axis=1, keepdims=True)


def _draft(key: jax.Array, draft_probs: np.ndarray) -> jax.Array:
    """`[TRIALS, K]` drafts, x_j ~ q_j independently (q does not depend on the context)."""
    logits = jnp.log(jnp.asarray(draft_probs, jnp.float32))  # [K, V]
    return jax.random.categorical(key, logits, shape=(TRIALS, NUM_DRAFTS)).astype(jnp.int32)


def _run(verifier, target_logits: np.ndarray, draft_probs: np.ndarray | None,
         drafts: jax.Array, params: SamplingArrays, seed: int = 0,
         num_draft_tokens: np.ndarray | None = None) -> Verification:
    """Runs one verifier over TRIALS identical rows (fixed p and q), each with its own key."""
    batch_logits = jnp.broadcast_to(jnp.asarray(target_logits, jnp.float32),
                                    (TRIALS, *target_logits.shape))  # [N, K + 1, V]
    batch_q = None if draft_probs is None else jnp.broadcast_to(
        jnp.asarray(draft_probs, jnp.float32), (TRIALS, *draft_probs.shape))  # [N, K, V]
    counts = (np.full((TRIALS,), NUM_DRAFTS, np.int32) if num_draft_tokens is None
              else num_draft_tokens)  # [N]
    keys = jax.random.split(jax.random.key(seed), TRIALS)  # [N]
    return jax.jit(verifier)(batch_logits, drafts, batch_q, jnp.asarray(counts), params, keys)


def _chi_square_p_value(tokens: np.ndarray, expected: np.ndarray) -> float:
    """p-value of the tokens' histogram against `expected` ([V] probabilities)."""
    observed = np.bincount(tokens, minlength=VOCAB)  # [V]
    support = expected > 1e-9
    assert observed[~support].sum() == 0, "a token outside the target's support was emitted"
    scaled = expected[support] / expected[support].sum() * observed[support].sum()
    return stats.chisquare(observed[support], scaled).pvalue


def _emitted_at(result: Verification, index: int) -> np.ndarray:
    """The index-th emitted token of every trial that emitted that many."""
    tokens, accepted = np.asarray(result.token_ids), np.asarray(result.num_accepted)
    return tokens[accepted >= index, index]


def _wrong_verify(target_logits, draft_token_ids, draft_probs, num_draft_tokens, params, keys):
    """A classic mistake: on rejection, draw from p instead of the residual max(0, p - q)."""
    batch, positions, _ = target_logits.shape
    probs = jax.nn.softmax(target_logits, axis=-1)  # [B, K + 1, V]
    accept_keys, final_keys = jax.vmap(lambda key: tuple(jax.random.split(key)))(keys)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key, (positions - 1,)))(accept_keys)
    count = first_rejection(acceptance_mask(probs[:, :-1], draft_probs, draft_token_ids,
                                            uniforms), num_draft_tokens)  # [B]
    final = jax.vmap(jax.random.categorical)(
        final_keys, jnp.log(probs[jnp.arange(batch), count]))  # [B]
    columns = jnp.arange(positions)[None, :]
    padded = jnp.pad(draft_token_ids, ((0, 0), (0, 1)))
    tokens = jnp.where(columns < count[:, None], padded, final[:, None])
    return Verification(tokens.astype(jnp.int32), count)


def test_emitted_tokens_follow_the_target_and_a_wrong_verifier_fails():
    target = _distributions(0, NUM_DRAFTS + 1)  # [K + 1, V] p_1..p_{K+1}
    draft = _distributions(1, NUM_DRAFTS)  # [K, V] q_1..q_K
    drafts = _draft(jax.random.key(1), draft)
    params = _params(TRIALS)
    result = _run(verify, np.log(target), draft, drafts, params)
    emitted = 0
    for index in range(3):  # the first, second and third emitted token
        tokens = _emitted_at(result, index)
        emitted += len(tokens)
        assert _chi_square_p_value(tokens, target[index]) > 1e-3, index
    assert emitted >= TRIALS
    # The acceptance rate matches 1 - TV(p_1, q_1) (METHODS.md section 5).
    first_accepted = np.mean(np.asarray(result.num_accepted) >= 1)
    expected_rate = 1 - 0.5 * np.abs(target[0] - draft[0]).sum()
    assert abs(first_accepted - expected_rate) < 0.01

    wrong = _run(_wrong_verify, np.log(target), draft, drafts, params)
    assert _chi_square_p_value(_emitted_at(wrong, 0), target[0]) < 1e-6


def test_point_mass_drafts_and_rows_with_fewer_drafts():
    target = _distributions(2, NUM_DRAFTS + 1)  # [K + 1, V]
    # Prompt lookup proposes the same fixed tokens every time; some rows propose fewer.
    drafts = jnp.broadcast_to(jnp.asarray([3, 3, 5], jnp.int32), (TRIALS, NUM_DRAFTS))
    counts = np.random.default_rng(0).integers(0, NUM_DRAFTS + 1, TRIALS).astype(np.int32)
    result = _run(verify, np.log(target), None, drafts, _params(TRIALS), seed=3,
                  num_draft_tokens=counts)
    accepted = np.asarray(result.num_accepted)
    assert np.all(accepted <= counts)
    for index in range(2):
        assert _chi_square_p_value(_emitted_at(result, index), target[index]) > 1e-3, index
    # Only the drafted token can be accepted: accepted prefixes equal the drafts.
    tokens = np.asarray(result.token_ids)
    assert np.all(tokens[accepted >= 1, 0] == 3)
    # A one-draft acceptance happens with probability p_1(x_1).
    one = counts >= 1
    assert abs(np.mean(accepted[one] >= 1) - target[0, 3]) < 0.01


def _reference_filtered(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """Slow, obvious temperature + top-k: softmax of the k largest scaled logits."""
    scaled = logits / temperature
    kept = np.argsort(-scaled)[:top_k]
    probs = np.zeros_like(scaled)
    probs[kept] = np.exp(scaled[kept] - scaled[kept].max())
    return probs / probs.sum()


def test_both_sides_use_the_samplers_temperature_and_top_k():
    rng = np.random.default_rng(4)
    target_logits = rng.normal(size=(NUM_DRAFTS + 1, VOCAB)) * 2  # [K + 1, V]
    draft_logits = rng.normal(size=(NUM_DRAFTS, VOCAB)) * 2  # [K, V]
    params = _params(TRIALS, temperature=0.8, top_k=5)
    q = np.asarray(sampling_probabilities(jnp.asarray(draft_logits, jnp.float32),
                                          _params(NUM_DRAFTS, 0.8, 5)))  # [K, V]
    for row in range(NUM_DRAFTS):
        np.testing.assert_allclose(q[row], _reference_filtered(draft_logits[row], 0.8, 5),
                                   atol=1e-6)
    result = _run(verify, target_logits, q, _draft(jax.random.key(5), q), params, seed=6)
    for index in range(2):
        expected = _reference_filtered(target_logits[index], 0.8, 5)
        assert _chi_square_p_value(_emitted_at(result, index), expected) > 1e-3, index


def test_greedy_rows_accept_the_argmax_prefix():
    rng = np.random.default_rng(7)
    batch = 64
    target_logits = rng.normal(size=(batch, NUM_DRAFTS + 1, VOCAB)).astype(np.float32)
    argmax = target_logits.argmax(-1)  # [B, K + 1]
    # Drafts that agree with the argmax for a random prefix, then disagree.
    drafts = argmax[:, :NUM_DRAFTS].copy()
    for row in range(batch):
        cut = rng.integers(0, NUM_DRAFTS + 1)
        drafts[row, cut:] = (drafts[row, cut:] + 1 + rng.integers(0, VOCAB - 1)) % VOCAB
    counts = rng.integers(0, NUM_DRAFTS + 1, batch).astype(np.int32)
    params = _params(batch, temperature=0.0)
    result = jax.jit(verify)(jnp.asarray(target_logits), jnp.asarray(drafts, jnp.int32), None,
                    jnp.asarray(counts), params, jax.random.split(jax.random.key(0), batch))
    for row in range(batch):
        expected = []
        for position in range(counts[row]):
            if drafts[row, position] != argmax[row, position]:
                break
            expected.append(int(drafts[row, position]))
        expected.append(int(argmax[row, len(expected)]))
        emitted = int(result.num_accepted[row]) + 1
        assert list(np.asarray(result.token_ids[row, :emitted])) == expected, row


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_without_drafts_sample_from_the_first_position(temperature):
    target_logits = np.log(_distributions(8, 2))[None].repeat(4, axis=0)  # [4, 2, V]
    result = jax.jit(verify)(jnp.asarray(target_logits, jnp.float32),
                             jnp.zeros((4, 1), jnp.int32),
                    None, jnp.zeros((4,), jnp.int32), _params(4, temperature),
                    jax.random.split(jax.random.key(9), 4))
    assert np.all(np.asarray(result.num_accepted) == 0)
    if temperature == 0.0:
        assert np.all(np.asarray(result.token_ids[:, 0]) == target_logits[0, 0].argmax())
