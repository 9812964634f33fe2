"""Cross-entropy and distillation divergences: hand-worked values, masking, gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train_distill.losses import (
    cross_entropy,
    distillation_loss,
    forward_kl,
    generalized_jsd,
    reverse_kl,
)

KEY = jax.random.key(0)
STUDENT = jax.random.normal(KEY, (2, 3, 7))
TEACHER = jax.random.normal(jax.random.key(1), (2, 3, 7)) * 2
MASK = jnp.ones((2, 3))
DIVERGENCES = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": lambda s, t, m, temperature=1.0: generalized_jsd(s, t, m, 0.5, temperature),
}


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_cross_entropy_hand_worked():
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))
    targets = jnp.array([[0, 1]])
    expected = -(np.log(0.5) + np.log(0.8)) / 2
    np.testing.assert_allclose(cross_entropy(logits, targets, jnp.ones((1, 2))), expected,
                               rtol=1e-6)


@pytest.mark.parametrize("kind", sorted(DIVERGENCES))
def test_zero_when_equal_positive_otherwise(kind):
    divergence = DIVERGENCES[kind]
    assert abs(float(divergence(TEACHER, TEACHER, MASK))) < 1e-6
    assert float(divergence(STUDENT, TEACHER, MASK)) > 1e-3


def test_forward_kl_hand_worked_and_reverse_is_swapped():
    student = np.array([[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
    teacher = np.array([[[0.0, 1.0, 0.0], [2.0, 0.0, -2.0]]])
    p, q = _softmax(teacher), _softmax(student)
    expected = np.mean(np.sum(p * np.log(p / q), axis=-1))
    mask = jnp.ones((1, 2))
    np.testing.assert_allclose(forward_kl(student, teacher, mask), expected, rtol=1e-5)
    np.testing.assert_allclose(reverse_kl(student, teacher, mask),
                               forward_kl(teacher, student, mask), rtol=1e-6)


def test_temperature_scaling_has_the_t_squared_factor():
    temperature = 2.0
    p, q = _softmax(np.asarray(TEACHER) / temperature), _softmax(np.asarray(STUDENT) / 2)
    expected = temperature ** 2 * np.mean(np.sum(p * np.log(p / q), axis=-1))
    np.testing.assert_allclose(forward_kl(STUDENT, TEACHER, MASK, temperature), expected,
                               rtol=1e-5)


def test_jsd_symmetric_at_half_and_bounded():
    forward = generalized_jsd(STUDENT, TEACHER, MASK, 0.5)
    backward = generalized_jsd(TEACHER, STUDENT, MASK, 0.5)
    np.testing.assert_allclose(forward, backward, rtol=1e-5)
    very_different = generalized_jsd(100 * STUDENT, -100 * STUDENT, MASK, 0.5, temperature=3.0)
    assert float(very_different) <= np.log(2) * 9 + 1e-5
    assert float(generalized_jsd(STUDENT, TEACHER, MASK, 0.0)) == 0.0
    with pytest.raises(ValueError, match=r"beta = 1\.5"):
        generalized_jsd(STUDENT, TEACHER, MASK, 1.5)


@pytest.mark.parametrize("kind", sorted(DIVERGENCES))
def test_masked_positions_do_not_count(kind):
    divergence = DIVERGENCES[kind]
    mask = jnp.array([[1, 1, 0], [1, 0, 0]], jnp.float32)
    changed = STUDENT.at[0, 2].set(50.0).at[1, 1:].set(-20.0)
    np.testing.assert_allclose(divergence(STUDENT, TEACHER, mask),
                               divergence(changed, TEACHER, mask), rtol=1e-6)
    assert float(divergence(STUDENT, TEACHER, jnp.zeros((2, 3)))) == 0.0


def test_gradients_reach_the_student_only():
    def loss(student, teacher):
        return distillation_loss(student, teacher, jnp.zeros((2, 3), jnp.int32), MASK,
                                 kind="jsd", temperature=2.0, ce_weight=0.3)[0]
    student_grad, teacher_grad = jax.grad(loss, argnums=(0, 1))(STUDENT, TEACHER)
    assert float(jnp.abs(student_grad).sum()) > 0
    assert float(jnp.abs(teacher_grad).sum()) == 0


@pytest.mark.parametrize("kind", sorted(DIVERGENCES))
def test_losses_fall_over_a_few_steps(kind):
    teacher = jax.random.normal(jax.random.key(5), (4, 8, 16)) * 3
    targets = jnp.argmax(teacher, axis=-1)
    student = jnp.zeros_like(teacher)
    optimizer = optax.adam(0.3)
    state = optimizer.init(student)

    def loss(student):
        return distillation_loss(student, teacher, targets, jnp.ones((4, 8)), kind=kind,
                                 temperature=1.5, ce_weight=0.2)[0]

    initial = float(loss(student))
    for _ in range(20):
        grads = jax.grad(loss)(student)
        updates, state = optimizer.update(grads, state)
        student = optax.apply_updates(student, updates)
    assert float(loss(student)) < 0.5 * initial


def test_mixture_and_metrics_and_bad_kind():
    targets = jnp.argmax(TEACHER, axis=-1)
    loss, metrics = distillation_loss(STUDENT, TEACHER, targets, MASK, kind="reverse_kl",
                                      temperature=1.0, ce_weight=0.25)
    np.testing.assert_allclose(loss, 0.25 * metrics["ce"] + 0.75 * metrics["divergence"],
                               rtol=1e-6)
    np.testing.assert_allclose(metrics["ce"], cross_entropy(STUDENT, targets, MASK), rtol=1e-6)
    _, same = distillation_loss(TEACHER, TEACHER, targets, MASK)
    assert float(same["top1_agreement"]) == 1.0
    with pytest.raises(ValueError, match="distillation kind 'kl' unknown"):
        distillation_loss(STUDENT, TEACHER, targets, MASK, kind="kl")
