"""Muon: Newton-Schulz orthogonalizes, one step equals the hand-computed update, OSP's split."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from train_distill.muon import (
    NS_COEFFICIENTS,
    matrix_view,
    muon,
    newton_schulz5,
    osp_label,
    osp_optimizer,
)


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (48, 128), (32, 32), (4, 24, 40)])
def test_newton_schulz_singular_values_land_near_one(shape):
    matrix = jax.random.normal(jax.random.key(sum(shape)), shape)
    orthogonalized = newton_schulz5(matrix)  # bfloat16 iterations, as in training
    singular_values = np.linalg.svd(np.asarray(orthogonalized), compute_uv=False)
    assert orthogonalized.shape == shape
    assert singular_values.min() >= 0.6 and singular_values.max() <= 1.3, singular_values


def _newton_schulz_by_hand(x: np.ndarray) -> np.ndarray:
    a, b, c = NS_COEFFICIENTS
    transposed = x.shape[0] > x.shape[1]
    x = x.T if transposed else x
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def test_two_muon_steps_equal_the_hand_computed_updates():
    rng = np.random.default_rng(0)
    theta = rng.normal(size=(3, 2))  # rows > cols: exercises the transpose
    gradients = [rng.normal(size=(3, 2)), rng.normal(size=(3, 2))]
    learning_rate, decay, beta = 0.1, 0.01, 0.95

    expected, momentum = theta.copy(), np.zeros_like(theta)
    for gradient in gradients:
        momentum = gradient + beta * momentum
        lookahead = gradient + beta * momentum
        direction = _newton_schulz_by_hand(lookahead) * math.sqrt(3) * 0.2
        expected = expected - learning_rate * (direction + decay * expected)

    optimizer = muon(learning_rate, weight_decay=decay, beta=beta, ns_dtype=jnp.float32)
    params = {"w": jnp.asarray(theta, jnp.float32)}
    state = optimizer.init(params)
    for gradient in gradients:
        updates, state = optimizer.update({"w": jnp.asarray(gradient, jnp.float32)}, state,
                                          params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(np.asarray(params["w"]), expected, atol=1e-5)


def test_osp_split_gives_embedding_head_norms_and_biases_to_adamw():
    config = get_preset("tiny").replace(norm_type="single_scale", embedding_projection=True,
                                        attention_bias=True)
    params = nnx.state(create_model(config), nnx.Param)
    labels = {jax.tree_util.keystr(path): osp_label(path, leaf)
              for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    for key, label in labels.items():
        is_adamw = ("embed" in key.split("]")[0] or "lm_head" in key or "norm" in key
                    or "_bias" in key)
        assert label == ("adamw" if is_adamw else "muon"), key
    assert labels["['input_projection'].value"] == "muon"


def test_attention_projections_are_orthogonalized_flattened():
    path = jax.tree_util.tree_leaves_with_path(
        {"layers": {0: {"attention": {"q_proj": 0, "o_proj": 0}}}})
    by_name = {jax.tree_util.keystr(p).split("'")[-2]: p for p, _ in path}
    assert matrix_view(by_name["q_proj"], (64, 4, 16)) == (64, 64)
    assert matrix_view(by_name["o_proj"], (4, 16, 32)) == (64, 32)


def test_osp_optimizer_lowers_a_model_loss():
    config = get_preset("tiny").replace(norm_type="single_scale", embedding_projection=True)
    model = create_model(config)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, config.vocab_size)
    optimizer = osp_optimizer(3e-3)
    state = optimizer.init(params)

    def loss(params):
        logits, _ = nnx.merge(graphdef, params)(tokens[:, :-1])  # [B, T, V]
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], -1))

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(8):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[-1] < losses[0] - 0.1, losses
