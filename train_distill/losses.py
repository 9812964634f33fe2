"""Training losses: next-token cross-entropy and knowledge-distillation divergences.

Every loss takes logits `[B, T, V]` (any dtype; the math runs in float32) and a `[B, T]` mask
(1 where a position counts) and returns the masked mean over positions, a float32 scalar. An
all-zero mask gives 0, not NaN. The teacher's logits are constants (stop_gradient): only the
student learns. Divergences at temperature T are scaled by T^2 so that their gradients keep the
same size as T changes (Hinton et al., 2015).

Notation follows METHODS.md section 4: teacher p = softmax(teacher / T), student
q = softmax(student / T).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `[B, T]` values over the positions where mask is nonzero, a scalar."""
    mask = mask.astype(jnp.float32)  # [B, T]
    # where, not values * mask: a NaN/inf at a masked (padding) position must not leak in.
    total = jnp.sum(jnp.where(mask > 0, values * mask, 0.0))
    # max(.., 1): an all-masked batch gives 0, not 0 / 0.
    return total / jnp.maximum(jnp.sum(mask), 1.0)


def _log_probs(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Float32 log-softmax over the vocabulary at a temperature, `[B, T, V]`."""
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)  # [B, T, V]


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """KL(p || q) per position from log-probabilities, `[B, T]`.

    Terms with p = 0 contribute 0 (the 0 log 0 = 0 convention), so a -inf logit (a banned or
    padded vocabulary entry) gives a finite loss instead of 0 * inf = NaN.
    """
    p = jnp.exp(log_p)  # [B, T, V]
    terms = jnp.where(p > 0, p * (log_p - log_q), 0.0)  # [B, T, V]
    return jnp.sum(terms, axis=-1)  # [B, T]


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, int | float) and not temperature > 0:
        raise ValueError(f"temperature = {temperature}: must be > 0")


def token_log_likelihood(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Log-probability of each target token (for perplexity and per-token scores).

    Args:
        logits: `[B, T, V]` predictions, any float dtype.
        targets: `[B, T]` int token ids.

    Returns:
        `[B, T]` float32 log p(target).
    """
    log_probs = _log_probs(logits)  # [B, T, V]
    return jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean next-token cross-entropy in nats; its exp is the perplexity.

    Args:
        logits: `[B, T, V]` predictions, any float dtype.
        targets: `[B, T]` int32 next tokens.
        mask: `[B, T]`, 1 where the position counts.

    Returns:
        Scalar float32 loss.
    """
    return _masked_mean(-token_log_likelihood(logits, targets), mask)


def forward_kl(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
               temperature: float = 1.0) -> jax.Array:
    """T^2 * KL(p || q), teacher to student: mean-seeking, the classic distillation loss.

    Args:
        student_logits: `[B, T, V]`, the side that learns.
        teacher_logits: `[B, T, V]`, treated as a constant.
        mask: `[B, T]`, 1 where the position counts.
        temperature: Softmax temperature applied to both sides, > 0.

    Returns:
        Scalar float32 loss, >= 0, 0 when the distributions match.
    """
    _check_temperature(temperature)
    log_p = _log_probs(jax.lax.stop_gradient(teacher_logits), temperature)  # [B, T, V]
    log_q = _log_probs(student_logits, temperature)  # [B, T, V]
    return temperature ** 2 * _masked_mean(_kl(log_p, log_q), mask)


def reverse_kl(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
               temperature: float = 1.0) -> jax.Array:
    """T^2 * KL(q || p), student to teacher: mode-seeking (MiniLLM, arXiv 2306.08543).

    Args:
        student_logits: `[B, T, V]`, the side that learns.
        teacher_logits: `[B, T, V]`, treated as a constant.
        mask: `[B, T]`, 1 where the position counts.
        temperature: Softmax temperature applied to both sides, > 0.

    Returns:
        Scalar float32 loss, >= 0, 0 when the distributions match.
    """
    _check_temperature(temperature)
    log_p = _log_probs(jax.lax.stop_gradient(teacher_logits), temperature)  # [B, T, V]
    log_q = _log_probs(student_logits, temperature)  # [B, T, V]
    return temperature ** 2 * _masked_mean(_kl(log_q, log_p), mask)


def generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
                    beta: float = 0.5, temperature: float = 1.0) -> jax.Array:
    """T^2 * (beta KL(p || m) + (1 - beta) KL(q || m)), m = beta p + (1 - beta) q (GKD).

    GKD (arXiv 2306.13649). At beta = 0.5 this is the symmetric Jensen-Shannon divergence,
    bounded by log(2) * T^2. At beta = 0 or 1 the mixture m equals q or p and the weighted
    divergence is identically zero, so those values are accepted and return an exact 0 (no
    gradient) rather than evaluating log(0) terms.

    Args:
        student_logits: `[B, T, V]`, the side that learns.
        teacher_logits: `[B, T, V]`, treated as a constant.
        mask: `[B, T]`, 1 where the position counts.
        beta: Teacher weight in the mixture, a Python float in [0, 1].
        temperature: Softmax temperature applied to both sides, > 0.

    Returns:
        Scalar float32 loss, >= 0.

    Raises:
        ValueError: If beta is outside [0, 1] or the temperature is not positive.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta = {beta}: must be in [0, 1]")
    _check_temperature(temperature)
    if beta in (0.0, 1.0):
        return jnp.zeros((), jnp.float32)
    log_p = _log_probs(jax.lax.stop_gradient(teacher_logits), temperature)  # [B, T, V]
    log_q = _log_probs(student_logits, temperature)  # [B, T, V]
    # log m in log space, logsumexp(log beta + log p, log(1 - beta) + log q): mixing the
    # probabilities directly would underflow for tokens both sides find unlikely.
    log_m = jnp.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)  # [B, T, V]
    divergence = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)  # [B, T]
    return temperature ** 2 * _masked_mean(divergence, mask)


def distillation_loss(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    *,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    ce_weight: float = 0.5,
    beta: float = 0.5,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`ce_weight * CE + (1 - ce_weight) * divergence`, with metrics.

    In METHODS.md's `(1 - w) CE + w T^2 KL`, ce_weight is 1 - w; the T^2 factor lives inside
    the divergence.

    Args:
        student_logits: `[B, T, V]`.
        teacher_logits: `[B, T, V]` from a frozen teacher with the same tokenizer (constant).
        targets: `[B, T]` int32 next tokens, for the hard-label CE part.
        mask: `[B, T]`, 1 where the position counts.
        kind: One of `DIVERGENCES`: "forward_kl", "reverse_kl" or "jsd".
        temperature: Softmax temperature of both sides inside the divergence (CE uses T = 1).
        ce_weight: Weight of the hard-label cross-entropy, in [0, 1].
        beta: JSD mixture weight (used by kind="jsd" only).

    Returns:
        `(loss, metrics)`, metrics holding scalars "ce", "divergence" (already T^2-scaled)
        and "top1_agreement" (fraction of masked-in positions where the student's argmax is
        the teacher's).

    Raises:
        ValueError: If kind is unknown or ce_weight is outside [0, 1].
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"distillation kind {kind!r} unknown; choose from {DIVERGENCES}")
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight = {ce_weight}: must be in [0, 1]")
    ce = cross_entropy(student_logits, targets, mask)
    if kind == "forward_kl":
        divergence = forward_kl(student_logits, teacher_logits, mask, temperature)
    elif kind == "reverse_kl":
        divergence = reverse_kl(student_logits, teacher_logits, mask, temperature)
    else:
        divergence = generalized_jsd(student_logits, teacher_logits, mask, beta, temperature)
    agrees = jnp.argmax(student_logits, -1) == jnp.argmax(teacher_logits, -1)  # [B, T]
    agreement = jax.lax.stop_gradient(_masked_mean(agrees.astype(jnp.float32), mask))
    loss = ce_weight * ce + (1.0 - ce_weight) * divergence
    return loss, {"ce": ce, "divergence": divergence, "top1_agreement": agreement}
