"""The in-place row handlers of XLA:CPU (`cpu_rows.py`) against the XLA ops they replace."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import cpu_rows

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's handlers")

DTYPES = ["float8_e4m3fn", "float8_e5m2", "float32", "uint8"]


def _pool(dtype: str, shape=(3, 5, 4, 6, 8)) -> jax.Array:
    values = np.random.default_rng(0).normal(size=shape).astype(np.float32) * 4
    if dtype == "uint8":
        return jnp.asarray(np.abs(values).astype(np.uint8))
    return jnp.asarray(values).astype(jnp.dtype(dtype))  # [L, P, Z, 2K, H]


def _floats(array: jax.Array) -> np.ndarray:
    return np.asarray(array.astype(jnp.float32))


def test_the_handlers_build_here():
    assert cpu_rows.available()
    assert cpu_rows.supports(_pool("float32"))
    with cpu_rows.disabled():
        assert not cpu_rows.supports(_pool("float32"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_rows_equals_a_scatter_and_drops_out_of_range_slots(dtype):
    pool = _pool(dtype)  # [3, 5, 4, 6, 8]: 20 token slots of [6, 8] a layer
    rows = _pool(dtype, (4, 6, 8))  # [T, 2K, H]
    slots = jnp.asarray([7, -1, 19, 20], jnp.int32)  # -1 and 20 are dropped
    expected = np.array(_floats(pool)).reshape(3, 20, 6, 8)
    expected[2, [7, 19]] = _floats(rows)[[0, 2]]
    got = jax.jit(cpu_rows.write_rows)(pool, rows, slots, 2)
    assert got.dtype == pool.dtype and got.shape == pool.shape
    np.testing.assert_array_equal(_floats(got).reshape(3, 20, 6, 8), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_read_rows_equals_a_gather_of_pages_and_of_slots(dtype):
    pool = _pool(dtype)
    pages = jnp.asarray([[4, 0], [-1, 2]], jnp.int32)  # -1: the last page, as numpy reads it
    np.testing.assert_array_equal(_floats(cpu_rows.read_rows(pool, 1, pages)),
                                  _floats(pool[1][pages]))  # [2, 2, Z, 2K, H]
    slots = jnp.asarray([3, 19], jnp.int32)
    np.testing.assert_array_equal(_floats(cpu_rows.read_rows(pool, 0, slots, row_rank=2)),
                                  _floats(pool[0].reshape(20, 6, 8)[slots]))


def test_a_loop_carried_pool_is_written_in_place():
    # The point of the handlers: no copy of the pool in the compiled layer loop.
    pool = _pool("float8_e4m3fn", (4, 64, 16, 4, 32))
    rows = _pool("float8_e4m3fn", (8, 4, 32))

    @functools.partial(jax.jit, donate_argnums=0)
    def layers(pool, rows):
        def layer(index, pool):
            return cpu_rows.write_rows(pool, rows, jnp.arange(8) * 16, index)
        return jax.lax.fori_loop(0, 4, layer, pool)

    text = layers.lower(pool, rows).compile().as_text()
    assert "jaxinfer_WriteRows" in text
    assert not [line for line in text.splitlines()
                if " copy(" in line and "f8e4m3fn[4,64,16,4,32]" in line]
