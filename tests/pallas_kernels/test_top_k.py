"""The C++ top-k and argmax of XLA:CPU (`pallas_kernels.top_k`) against `jax.lax.top_k` and
`jnp.argmax`, ties, infinities and NaN included, and their routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import top_k as top_k_module
from pallas_kernels.top_k import argmax, top_k

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernel"),
    pytest.mark.skipif(not top_k_module.available(), reason="needs a C++ compiler"),
]


def _rows(kind: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "ties":  # few distinct values: most entries tie with others
        return rng.integers(-3, 4, shape).astype(np.float32)
    if kind == "infinities":  # masked logits, as a grammar or logit bias leaves them
        x = rng.standard_normal(shape).astype(np.float32)
        x[rng.random(shape) < 0.7] = -np.inf
        x[..., 5] = np.inf
        return x
    if kind == "nan":
        x = rng.standard_normal(shape).astype(np.float32)
        x[..., 3] = np.nan
        x[..., -1] = -0.0  # below +0.0 in the total order
        x[..., -2] = 0.0
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["normal", "ties", "infinities", "nan"])
@pytest.mark.parametrize("shape,k", [((1, 49152), 8), ((3, 1000), 1), ((2, 5, 37), 37),
                                     ((4, 13), 5), ((1, 7), 3)])
def test_top_k_equals_lax_top_k(kind, shape, k):
    x = jnp.asarray(_rows(kind, shape))
    values, indices = jax.jit(lambda a: top_k(a, k))(x)
    want_values, want_indices = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


@pytest.mark.parametrize("kind", ["normal", "ties", "infinities"])
def test_argmax_equals_jnp_argmax(kind):
    x = jnp.asarray(_rows(kind, (6, 3001), seed=1))
    got = jax.jit(argmax)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))


def test_the_cpu_program_calls_the_kernel_and_disabled_keeps_xla():
    x = jnp.zeros((2, 64), jnp.float32)
    assert "jaxinfer_TopK" in jax.jit(lambda a: top_k(a, 4)).lower(x).as_text()
    with top_k_module.disabled():
        text = jax.jit(lambda a: top_k(a, 4)).lower(x).as_text()
    assert "jaxinfer_TopK" not in text


def test_k_out_of_range_names_k():
    with pytest.raises(ValueError, match="k=9"):
        top_k(jnp.zeros((2, 8), jnp.float32), 9)
