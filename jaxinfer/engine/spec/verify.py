"""Exact speculative sampling on device: verify R drafted tokens against the target, batched.

A drafter proposes `x_1 .. x_R` from distributions `q_1 .. q_R`; the target scores the prefix
plus the drafts in one pass, giving `p_1 .. p_{R+1}` (METHODS.md section 5, arXiv 2211.17192
and 2302.01318). For i = 1..R, `x_i` is accepted with probability `min(1, p_i(x_i) / q_i(x_i))`;
the first rejection emits a token from the residual `norm(max(0, p_i - q_i))` and stops; if all
R are accepted one bonus token is drawn from `p_{R+1}`. The emitted tokens are then distributed
exactly as if each had been sampled from the target, one step at a time.

Both p and q are taken after the same transform the engine's sampler applies
(`jaxinfer.engine.device.sampler`: bias, penalties and min_tokens, then temperature, min_p,
top-k and top-p), so a speculating request draws from exactly the distribution it would draw
from without speculation. Greedy rows (temperature ~0 or top_k == 1) are the special case
"accept while `x_i == argmax p_i`, then emit `argmax p_{first mismatch}`", which is the token a
greedy request would emit at each step. Prompt-lookup (n-gram) drafts have no distribution:
they are a point-mass drafter, `q_i = one_hot(x_i)`, for which the rule becomes "accept with
probability `p_i(x_i)`, on rejection draw from p_i with x_i removed".

Every row has its own number of drafts (0 to R; rows with 0 just sample from `p_1`), its own
sampling parameters and its own key, so one compiled program serves any mix of requests.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.engine.device.sampler import (
    SamplingArrays,
    filter_for_sampling,
    greedy_rows,
    process_logits,
)


class Verification(NamedTuple):
    """What `verify` emits per row.

    Attributes:
        token_ids: `[B, R + 1]` int32; the first `num_accepted + 1` are the row's new tokens
            (its accepted drafts, then the correction or bonus token); the rest is padding.
        num_accepted: `[B]` int32, accepted drafts, in `[0, num_draft_tokens]`.
    """

    token_ids: jax.Array
    num_accepted: jax.Array


def repeat_rows(params: SamplingArrays, repeats: int) -> SamplingArrays:
    """Repeats each row's settings `repeats` times, so `[B * repeats, V]` logits can use them.

    Args:
        params: `[B]`-row settings.
        repeats: How many consecutive positions each row scores.

    Returns:
        `[B * repeats]`-row settings, row `b * repeats + j` equal to row `b`.
    """
    return jax.tree.map(lambda array: jnp.repeat(jnp.asarray(array), repeats, axis=0), params)


def sampling_probabilities(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """The distribution a sampled row draws from: the sampler's transform, then softmax.

    Args:
        logits: `[rows, V]` raw logits.
        params: `[rows]`-row settings.

    Returns:
        `[rows, V]` float32 probabilities (zero outside each row's kept set). Greedy rows get
        their temperature-1 distribution, which callers ignore.
    """
    filtered = filter_for_sampling(process_logits(logits, params), params)  # [rows, V]
    return jax.nn.softmax(filtered, axis=-1)  # [rows, V]


def point_mass(draft_token_ids: jax.Array, vocab_size: int) -> jax.Array:
    """`q_i = one_hot(x_i)`: the distributions of a drafter that proposes tokens for certain.

    Args:
        draft_token_ids: `[B, R]` int32.
        vocab_size: V.

    Returns:
        `[B, R, V]` float32.
    """
    return jax.nn.one_hot(draft_token_ids, vocab_size, dtype=jnp.float32)  # [B, R, V]


def acceptance_mask(target_probs: jax.Array, draft_probs: jax.Array,
                    draft_token_ids: jax.Array, uniforms: jax.Array) -> jax.Array:
    """Accepts each draft with probability `min(1, p(x) / q(x))`.

    Compared as `u * q(x) < p(x)`, which needs no division (q(x) > 0 for a sampled draft).

    Args:
        target_probs: `[B, R, V]` p_1..p_R.
        draft_probs: `[B, R, V]` q_1..q_R.
        draft_token_ids: `[B, R]` x_1..x_R.
        uniforms: `[B, R]` float32 in [0, 1).

    Returns:
        `[B, R]` bool, per draft independently (the caller stops at the first False).
    """
    index = draft_token_ids[..., None]  # [B, R, 1]
    p_of_draft = jnp.take_along_axis(target_probs, index, axis=-1)[..., 0]  # [B, R]
    q_of_draft = jnp.take_along_axis(draft_probs, index, axis=-1)[..., 0]  # [B, R]
    return uniforms * q_of_draft < p_of_draft  # [B, R]


def residual_distribution(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
    """`norm(max(0, p - q))`, the distribution to draw from after a rejection.

    If p <= q everywhere (only possible when p == q, where no rejection can happen; or by
    rounding), the residual is empty and p itself is returned, so the result is always a
    distribution.

    Args:
        target_probs: `[..., V]` p.
        draft_probs: `[..., V]` q.

    Returns:
        `[..., V]` float32.
    """
    residual = jnp.maximum(target_probs - draft_probs, 0.0)  # [..., V]
    mass = jnp.sum(residual, axis=-1, keepdims=True)  # [..., 1]
    return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0),
                     target_probs)  # [..., V]


def first_rejection(accepted: jax.Array, num_draft_tokens: jax.Array) -> jax.Array:
    """Counts the leading accepted drafts of each row, among its first `num_draft_tokens`.

    Args:
        accepted: `[B, R]` bool.
        num_draft_tokens: `[B]` int32 in [0, R].

    Returns:
        `[B]` int32.
    """
    positions = jnp.arange(accepted.shape[1])[None, :]  # [1, R]
    valid = accepted & (positions < num_draft_tokens[:, None])  # [B, R]
    return jnp.sum(jnp.cumprod(valid.astype(jnp.int32), axis=1), axis=1)  # [B]


def verify(target_logits: jax.Array, draft_token_ids: jax.Array, draft_probs: jax.Array | None,
           num_draft_tokens: jax.Array, params: SamplingArrays, keys: jax.Array
           ) -> Verification:
    """Exact speculative sampling for a batch of rows with 0..R drafts each.

    Args:
        target_logits: `[B, R + 1, V]` the target's logits at the last known token and at
            each draft (position j predicts the token after draft j); positions past a row's
            drafts are ignored.
        draft_token_ids: `[B, R]` int32 x_1..x_R (padding past a row's drafts).
        draft_probs: `[B, R, V]` q_1..q_R after the sampler's transform, or None for
            point-mass (n-gram) drafts.
        num_draft_tokens: `[B]` int32 in [0, R].
        params: `[B]`-row sampling settings; penalties and min_tokens are applied to every
            position alike, so the caller only speculates for rows where they are constant.
        keys: `[B]` PRNG keys, one per row.

    Returns:
        The emitted tokens and accepted counts.
    """
    batch, positions, vocab = target_logits.shape
    num_drafts = positions - 1
    if draft_probs is None:
        draft_probs = point_mass(draft_token_ids, vocab)  # [B, R, V]
    repeated = repeat_rows(params, positions)
    flat_logits = target_logits.reshape(batch * positions, vocab)  # [B * (R + 1), V]
    greedy = greedy_rows(params)  # [B]
    argmax = jnp.argmax(process_logits(flat_logits, repeated),
                        axis=-1).astype(jnp.int32)  # [B * (R + 1)]
    argmax = argmax.reshape(batch, positions)  # [B, R + 1]
    greedy_accepted = draft_token_ids == argmax[:, :num_drafts]  # [B, R]
    greedy_count = first_rejection(greedy_accepted, num_draft_tokens)  # [B]
    greedy_final = jnp.take_along_axis(argmax, greedy_count[:, None], axis=1)[:, 0]  # [B]

    def sampled() -> tuple[jax.Array, jax.Array]:
        target_probs = sampling_probabilities(flat_logits, repeated).reshape(
            batch, positions, vocab)  # [B, R + 1, V]
        accept_keys, final_keys = jax.vmap(
            lambda key: tuple(jax.random.split(key)))(keys)  # [B], [B]
        uniforms = jax.vmap(lambda key: jax.random.uniform(key, (num_drafts,)))(
            accept_keys)  # [B, R]
        accepted = acceptance_mask(target_probs[:, :num_drafts], draft_probs, draft_token_ids,
                                   uniforms)  # [B, R]
        count = first_rejection(accepted, num_draft_tokens)  # [B]
        rows = jnp.arange(batch)  # [B]
        p_at = target_probs[rows, count]  # [B, V]
        # The draft at the stopping position, or zeros after the last draft (bonus token).
        q_at = jnp.where((count < num_draft_tokens)[:, None],
                         draft_probs[rows, jnp.minimum(count, num_drafts - 1)]
                         if num_drafts else jnp.zeros_like(p_at), 0.0)  # [B, V]
        final_probs = residual_distribution(p_at, q_at)  # [B, V]
        final = jax.vmap(jax.random.categorical)(final_keys, jnp.log(final_probs))  # [B]
        return (jnp.where(greedy, greedy_count, count),  # [B]
                jnp.where(greedy, greedy_final, final.astype(jnp.int32)))  # [B]

    # An all-greedy batch skips the [B * (R + 1), V] sorts of top-k and top-p.
    count, final = jax.lax.cond(jnp.all(greedy), lambda: (greedy_count, greedy_final),
                                sampled)  # [B], [B]
    columns = jnp.arange(positions)[None, :]  # [1, R + 1]
    padded_drafts = jnp.pad(draft_token_ids, ((0, 0), (0, 1)))  # [B, R + 1]
    tokens = jnp.where(columns < count[:, None], padded_drafts,
                       jnp.where(columns == count[:, None], final[:, None], 0))  # [B, R + 1]
    return Verification(tokens.astype(jnp.int32), count.astype(jnp.int32))  # [B, R + 1], [B]
