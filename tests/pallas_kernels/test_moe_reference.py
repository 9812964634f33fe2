"""The sorted ragged_dot MoE dispatch equals the dense all-experts computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import moe_dense, moe_ffn, moe_sorted, route_top_k, sort_by_expert


def test_route_top_k_hand_worked():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.125, 0.125]]))
    weights, experts = route_top_k(logits, 2)
    np.testing.assert_array_equal(experts, [[3, 2], [0, 1]])
    np.testing.assert_allclose(weights, [[0.4 / 0.7, 0.3 / 0.7], [2 / 3, 1 / 3]], rtol=1e-6)


def test_sort_by_expert_groups_and_handles_empty_experts():
    experts = jnp.array([[2, 0], [2, 3], [0, 2]], jnp.int32)
    order, sizes = sort_by_expert(experts, 5)
    np.testing.assert_array_equal(sizes, [2, 0, 3, 1, 0])
    np.testing.assert_array_equal(experts.reshape(-1)[order], [0, 0, 2, 2, 2, 3])


@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 4, 2), (7, 4, 2), (33, 8, 2),
                                                              (16, 8, 1), (5, 3, 3)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sorted_equals_dense(tokens, num_experts, top_k, dtype):
    keys = jax.random.split(jax.random.key(tokens * 31 + num_experts), 5)
    width, hidden = 16, 24
    x = jax.random.normal(keys[0], (tokens, width), dtype)
    router = jax.random.normal(keys[1], (tokens, num_experts))
    gate = (0.3 * jax.random.normal(keys[2], (num_experts, width, hidden))).astype(dtype)
    up = (0.3 * jax.random.normal(keys[3], (num_experts, width, hidden))).astype(dtype)
    down = (0.3 * jax.random.normal(keys[4], (num_experts, hidden, width))).astype(dtype)
    weights, experts = route_top_k(router, top_k)
    dense = moe_dense(x, weights, experts, gate, up, down)
    sorted_out = moe_sorted(x, weights, experts, gate, up, down)
    tolerance = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(sorted_out, np.float32), np.asarray(dense, np.float32),
                               rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(
        np.asarray(moe_ffn(x, router, gate, up, down, top_k), np.float32),
        np.asarray(sorted_out, np.float32))


def test_dense_matches_a_per_token_loop():
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (3, 4))
    router = jax.random.normal(keys[1], (3, 3))
    gate, up = (jax.random.normal(k, (3, 4, 5)) for k in keys[2:4])
    down = jax.random.normal(keys[4], (3, 5, 4))
    weights, experts = route_top_k(router, 2)
    expected = np.zeros((3, 4), np.float32)
    for t in range(3):
        for slot in range(2):
            e = int(experts[t, slot])
            hidden = jax.nn.silu(x[t] @ gate[e]) * (x[t] @ up[e])
            expected[t] += float(weights[t, slot]) * np.asarray(hidden @ down[e])
    np.testing.assert_allclose(moe_dense(x, weights, experts, gate, up, down), expected,
                               rtol=1e-5, atol=1e-5)


def test_unknown_implementation_rejected():
    with pytest.raises(ValueError, match="unknown MoE implementation 'fast'"):
        moe_ffn(jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.ones((2, 2, 2)), jnp.ones((2, 2, 2)),
                jnp.ones((2, 2, 2)), 1, implementation="fast")
