"""Training losses: next-token cross-entropy and knowledge-distillation divergences.

Every loss takes logits `[B, T, V]` (any dtype; the math runs in float32) and a `[B, T]` mask
(1 where a position counts) and returns the masked mean over positions. The teacher's logits
are constants (stop_gradient): only the student learns. Divergences at temperature T are
scaled by T^2 so that their gradients keep the same size as T changes (Hinton et al.).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(jnp.float32)
    # max(.., 1): an all-masked batch gives 0, not NaN.
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_log_likelihood(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) per position, `[B, T]` float32."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, T]


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean next-token cross-entropy (nats); exp of it is the perplexity.

    Args:
        logits: `[B, T, V]` predictions.
        targets: `[B, T]` int32 next tokens.
        mask: `[B, T]` 1 where the position counts.
    """
    return _masked_mean(-token_log_likelihood(logits, targets), mask)


def _log_probs(logits: jax.Array, temperature: float) -> jax.Array:
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)  # [B, T, V]


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """KL(p || q) per position from log-probabilities, `[B, T]`."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def forward_kl(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
               temperature: float = 1.0) -> jax.Array:
    """T^2 * KL(teacher || student): mean-seeking, the classic distillation loss."""
    log_p = _log_probs(jax.lax.stop_gradient(teacher_logits), temperature)  # [B, T, V]
    log_q = _log_probs(student_logits, temperature)  # [B, T, V]
    return temperature ** 2 * _masked_mean(_kl(log_p, log_q), mask)


def reverse_kl(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
               temperature: float = 1.0) -> jax.Array:
    """T^2 * KL(student || teacher): mode-seeking (MiniLLM)."""
    log_p = _log_probs(jax.lax.stop_gradient(teacher_logits), temperature)  # [B, T, V]
    log_q = _log_probs(student_logits, temperature)  # [B, T, V]
    return temperature ** 2 * _masked_mean(_kl(log_q, log_p), mask)


def generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
                    beta: float = 0.5, temperature: float = 1.0) -> jax.Array:
    """T^2 * (beta KL(p || m) + (1 - beta) KL(q || m)), m = beta p + (1 - beta) q (GKD).

    At beta 0 or 1 the mixture equals one side and the divergence is identically zero;
    those values are accepted and give a zero loss.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta = {beta}: must be in [0, 1]")
    if beta in (0.0, 1.0):
        return jnp.zeros((), jnp.float32)
    log_p = _log_probs(jax.lax.stop_gradient(teacher_logits), temperature)  # [B, T, V]
    log_q = _log_probs(student_logits, temperature)  # [B, T, V]
    # log m computed in log space: logsumexp(log beta + log p, log(1 - beta) + log q).
    log_m = jnp.logaddexp(math.log(beta) + log_p, math.log(1.0 - beta) + log_q)  # [B, T, V]
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

    Args:
        student_logits: `[B, T, V]`.
        teacher_logits: `[B, T, V]` from a frozen teacher with the same tokenizer.
        targets: `[B, T]` next tokens (for the CE part).
        mask: `[B, T]`.
        kind: "forward_kl", "reverse_kl" or "jsd".
        temperature: Softmax temperature of both sides inside the divergence.
        ce_weight: Weight of the hard-label cross-entropy, in [0, 1].
        beta: JSD mixture weight.

    Returns:
        `(loss, {"ce", "divergence", "top1_agreement"})`.
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
    agreement = _masked_mean((jnp.argmax(student_logits, -1) ==
                              jnp.argmax(teacher_logits, -1)).astype(jnp.float32), mask)
    loss = ce_weight * ce + (1.0 - ce_weight) * divergence
    return loss, {"ce": ce, "divergence": divergence, "top1_agreement": agreement}
