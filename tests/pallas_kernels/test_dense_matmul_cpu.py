"""The C++ matmul of the XLA:CPU path against XLA's dot (the reference), and its routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense_matmul import cpu, dense_matmul, dense_matmul_reference

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernel"),
    # The kernel's only fast path is AVX-512; elsewhere (an AVX2 CPU) XLA's dot runs.
    pytest.mark.skipif(not cpu.available(), reason="needs a C++ compiler and AVX-512"),
]


def _arrays(rows: int, depth: int, columns: int, layers: int = 1, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.float32)  # [M, K]
    stack = jnp.asarray(rng.standard_normal((layers, depth, columns)), jnp.float32)  # [L, K, N]
    return x, stack


# Rows cover the streaming path (<= 16: one group, a partial group, two groups), the register
# tiles (a partial 6-row tile, many tiles) and the limit; depths and columns cover vector and
# quad tails (100 = 6 x 16 + 4, 37 odd) and more than one depth block (300 > 128).
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 17, 64, 256])
@pytest.mark.parametrize("depth,columns", [(64, 64), (100, 37), (300, 200)])
def test_kernel_matches_xla_dot(rows, depth, columns):
    x, stack = _arrays(rows, depth, columns)
    weight = stack[0]  # [K, N]
    want = np.asarray(x, np.float64) @ np.asarray(weight, np.float64)  # [M, N]
    got = jax.jit(lambda a, b: cpu.matmul(a, b))(x, weight)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.sqrt(depth))
    transposed = jnp.asarray(np.asarray(weight).T.copy())  # [N, K]
    if rows <= cpu.MAX_ROWS_TRANSPOSED:
        got = jax.jit(lambda a, b: cpu.matmul(a, b, transposed=True))(x, transposed)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4,
                                   atol=1e-4 * np.sqrt(depth))


def test_a_stacked_weight_is_read_at_the_traced_layer():
    x, stack = _arrays(5, 96, 80, layers=4)

    def per_layer(a, b):
        return jax.lax.map(lambda layer: cpu.matmul(a, b, layer=layer), jnp.arange(4))

    got = np.asarray(jax.jit(per_layer)(x, stack))  # [L, M, N]
    want = np.einsum("mk,lkn->lmn", np.asarray(x, np.float64), np.asarray(stack, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    # Inside a scan the layer index stays a runtime operand: one custom call, no slice copy.
    text = jax.jit(per_layer).lower(x, stack).as_text()
    assert text.count("jaxinfer_DenseMatmulF32") == 1


def test_gradients_match_xla_dot():
    x, stack = _arrays(4, 48, 40, layers=3)

    def loss(function):
        return lambda a, b: jnp.sum(jnp.sin(function(a, b)))

    kernel = loss(lambda a, b: cpu.matmul(a, b, layer=1))
    reference = loss(lambda a, b: a @ b[1])
    for got, want in zip(jax.grad(kernel, argnums=(0, 1))(x, stack),
                         jax.grad(reference, argnums=(0, 1))(x, stack)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_routing_takes_the_kernel_only_where_it_is_faster_and_exact():
    x, stack = _arrays(8, 64, 32)
    weight = stack[0]

    def lowered(a, b, **options):
        return jax.jit(lambda a, b: dense_matmul(a, b, **options)).lower(a, b).as_text()

    assert "jaxinfer_DenseMatmulF32" in lowered(x, weight)
    # Eager calls keep XLA's dot (a kernel call would compile its own programs per shape).
    assert not cpu.supports(x, weight)
    # Leading axes are flattened into rows.
    assert "jaxinfer_DenseMatmulF32" in lowered(x.reshape(2, 4, 64), weight)
    # bfloat16, more rows than the kernel wins at, and a switched-off kernel keep XLA's dot.
    assert "jaxinfer_" not in lowered(x.astype(jnp.bfloat16), weight.astype(jnp.bfloat16))
    many = jnp.zeros((cpu.MAX_ROWS + 1, 64), jnp.float32)
    assert "jaxinfer_" not in lowered(many, weight)
    assert "jaxinfer_" not in lowered(x[:, :32].repeat(cpu.MAX_ROWS_TRANSPOSED + 1, 0)[:, :32],
                                      weight, transposed=True)
    with cpu.disabled():
        assert "jaxinfer_" not in lowered(x, weight)
    # Both routes give the same numbers.
    np.testing.assert_allclose(np.asarray(dense_matmul(x, weight)),
                               np.asarray(dense_matmul_reference(x, weight)),
                               rtol=1e-5, atol=1e-5)


def test_a_weight_sharded_over_a_mesh_keeps_xla_dot():
    if jax.device_count() < 2:
        pytest.skip("needs two devices")
    mesh = jax.make_mesh((2,), ("model",))
    x, stack = _arrays(4, 64, 32)
    with jax.set_mesh(mesh):
        text = jax.jit(lambda a, b: dense_matmul(a, b)).lower(x, stack[0]).as_text()
    assert "jaxinfer_" not in text
