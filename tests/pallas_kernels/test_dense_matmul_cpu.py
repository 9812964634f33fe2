"""The C++ matmul of the XLA:CPU path against XLA's dot (the reference), and its routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense_matmul import cpu, dense_matmul, dense_matmul_reference

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernel"),
    # The kernel's paths are AVX-512 and AVX2 + FMA; elsewhere XLA's dot runs.
    pytest.mark.skipif(not cpu.available(), reason="needs a C++ compiler and AVX2 or AVX-512"),
]


def _arrays(rows: int, depth: int, columns: int, layers: int = 1, seed: int = 0,
            weight_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.float32)  # [M, K]
    stack = jnp.asarray(rng.standard_normal((layers, depth, columns)),
                        weight_dtype)  # [L, K, N]
    return x, stack


# Rows cover the streaming path (<= 16: one group, a partial group, two groups), the register
# tiles (a partial 6-row tile, many tiles) and the limit; depths and columns cover vector and
# quad tails (100 = 6 x 16 + 4, 37 odd) and more than one depth block (300 > 128). bfloat16
# weights (read as stored, widened in registers) take the AVX2 path on every x86 CPU. Past
# 16 rows the AVX2 path multiplies float32 panels of 16 columns (64 and 48 columns; 200 and
# 37 are not whole panels and take the readable loop), transposed ones packed on the way.
@pytest.mark.parametrize("weight_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 17, 64, 256])
@pytest.mark.parametrize("depth,columns", [(64, 64), (100, 37), (300, 200), (300, 48)])
def test_kernel_matches_xla_dot(rows, depth, columns, weight_dtype):
    x, stack = _arrays(rows, depth, columns, weight_dtype=weight_dtype)
    weight = stack[0]  # [K, N]
    want = np.asarray(x, np.float64) @ np.asarray(weight, np.float64)  # [M, N]
    got = jax.jit(lambda a, b: cpu.matmul(a, b))(x, weight)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.sqrt(depth))
    transposed = jnp.asarray(np.asarray(weight).T.copy())  # [N, K]
    if rows <= max(cpu.MAX_ROWS_TRANSPOSED, cpu.max_rows(weight_dtype, transposed=True)):
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


@pytest.mark.parametrize("weight_dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_xla_dot(weight_dtype):
    x, stack = _arrays(4, 48, 40, layers=3, weight_dtype=weight_dtype)

    def loss(function):
        return lambda a, b: jnp.sum(jnp.sin(function(a, b)))

    kernel = loss(lambda a, b: cpu.matmul(a, b, layer=1))
    reference = loss(lambda a, b: a @ b[1].astype(jnp.float32))
    for got, want in zip(jax.grad(kernel, argnums=(0, 1))(x, stack),
                         jax.grad(reference, argnums=(0, 1))(x, stack)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-2 if weight_dtype == jnp.bfloat16 else 1e-4,
                                   atol=1e-5)


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
    # A bfloat16 weight under float32 activations is read as stored.
    assert "jaxinfer_DenseMatmulF32" in lowered(x, weight.astype(jnp.bfloat16))
    # bfloat16 activations, more rows than the kernel wins at, and a switched-off kernel
    # keep XLA's dot.
    assert "jaxinfer_" not in lowered(x.astype(jnp.bfloat16), weight.astype(jnp.bfloat16))
    many = jnp.zeros((cpu.max_rows(jnp.float32) + 1, 64), jnp.float32)
    assert "jaxinfer_" not in lowered(many, weight)
    assert "jaxinfer_" not in lowered(many, weight.astype(jnp.bfloat16).T, transposed=True)
    with cpu.disabled():
        assert "jaxinfer_" not in lowered(x, weight)
    # Both routes give the same numbers; a bfloat16 weight off the kernel (eager, or past
    # its rows) is widened after its layer is sliced.
    np.testing.assert_allclose(np.asarray(dense_matmul(x, weight)),
                               np.asarray(dense_matmul_reference(x, weight)),
                               rtol=1e-5, atol=1e-5)
    narrow = jnp.stack([weight, 2 * weight]).astype(jnp.bfloat16)  # [2, K, N]
    for rows in (x, many):
        want = dense_matmul_reference(rows, 2 * narrow[0].astype(jnp.float32))
        got = jax.jit(lambda a, b: dense_matmul(a, b, layer=1))(rows, narrow)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_a_weight_sharded_over_a_mesh_keeps_xla_dot():
    if jax.device_count() < 2:
        pytest.skip("needs two devices")
    mesh = jax.make_mesh((2,), ("model",))
    x, stack = _arrays(4, 64, 32)
    with jax.set_mesh(mesh):
        text = jax.jit(lambda a, b: dense_matmul(a, b)).lower(x, stack[0]).as_text()
    assert "jaxinfer_" not in text
