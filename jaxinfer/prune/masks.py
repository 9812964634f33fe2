"""Magnitude and Wanda pruning: a score per weight, and the mask that keeps the highest.

Weights are `[I, O]` here (input rows, output columns), the transpose of the papers'
`[out, in]`: the papers' "output row" is an output column here, and every selection is
made per output column, over its I inputs (METHODS.md section 7):

- unstructured, sparsity p: each output's `round(p * I)` lowest-scoring inputs are zeroed,
  so every output has exactly the same sparsity;
- N:M: in every M consecutive inputs of one output, the N lowest-scoring are zeroed.

Scores:
- magnitude: `|W_ij|`, the baseline;
- Wanda (Sun et al., ICLR 2024): `|W_ij| * ||X_i||_2`, the weight times the L2 norm over
  the calibration tokens of its input feature; no weight update.

Ties are broken by input index (a stable sort: the earlier input is zeroed first), so
masks are deterministic. Selection runs in numpy on the host, like GPTQ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.prune.config import PruningScheme


def magnitude_scores(weight: jax.Array | np.ndarray) -> np.ndarray:
    """`[I, O]` float64 `|W|` of an `[I, O]` weight."""
    return np.abs(np.asarray(weight, np.float64))  # [I, O]


def input_norms(inputs: jax.Array) -> np.ndarray:
    """`[I]` float64 L2 norm over the tokens of each input feature of `[T, I]` inputs
    (accumulated in float32 on the device)."""
    x = jnp.asarray(inputs, jnp.float32)  # [T, I]
    return np.sqrt(np.asarray(jnp.sum(jnp.square(x), axis=0), np.float64))  # [I]


def wanda_scores(weight: jax.Array | np.ndarray, norms: np.ndarray) -> np.ndarray:
    """`[I, O]` float64 Wanda scores `|W_ij| * ||X_i||` from `[I]` input norms."""
    return magnitude_scores(weight) * np.asarray(norms, np.float64)[:, None]  # [I, O]


def keep_mask(scores: np.ndarray, sparsity: float | None = None,
              pattern: tuple[int, int] | None = None) -> np.ndarray:
    """`[I, O]` bool mask, True where the weight is kept, from `[I, O]` scores.

    Args:
        scores: Higher is more important.
        sparsity: Each output's `round(sparsity * I)` lowest scores are zeroed.
        pattern: `(N, M)`: the N lowest of every M consecutive inputs of an output are
            zeroed (instead of `sparsity`).

    Raises:
        ValueError: Neither or both targets, or I not a multiple of M.
    """
    if (sparsity is None) == (pattern is None):
        raise ValueError("give exactly one of sparsity and pattern")
    scores = np.asarray(scores)  # [I, O]
    k, n = scores.shape
    if sparsity is not None:
        return _lowest_zeroed(scores, round(sparsity * k))
    zeroed, m = pattern
    if k % m:
        raise ValueError(f"I={k} inputs are not a multiple of M={m} for {zeroed}:{m}")
    # [I / M, M, O]: each group of M consecutive inputs selected on its own (axis 1).
    grouped = scores.reshape(k // m, m, n)
    order = np.argsort(grouped, axis=1, kind="stable")  # [I / M, M, O]
    mask = np.ones_like(grouped, bool)  # [I / M, M, O]
    np.put_along_axis(mask, order[:, :zeroed], False, axis=1)
    return mask.reshape(k, n)  # [I, O]


def _lowest_zeroed(scores: np.ndarray, count: int) -> np.ndarray:
    """`[I, O]` keep mask zeroing the `count` lowest scores of every output column."""
    mask = np.ones(scores.shape, bool)  # [I, O]
    if count:
        order = np.argsort(scores, axis=0, kind="stable")  # [I, O]
        np.put_along_axis(mask, order[:count], False, axis=0)
    return mask


def scheme_mask(scores: np.ndarray, scheme: PruningScheme,
                sparsity: float | None = None) -> np.ndarray:
    """`keep_mask` for `scheme`'s target; `sparsity` overrides an unstructured scheme's
    (OWL's layer sparsity)."""
    if scheme.pattern is not None:
        return keep_mask(scores, pattern=scheme.pattern)
    return keep_mask(scores, sparsity=scheme.sparsity if sparsity is None else sparsity)


def prune_matrix(weight: jax.Array | np.ndarray, scheme: PruningScheme,
                 norms: np.ndarray | None = None, sparsity: float | None = None
                 ) -> np.ndarray:
    """Magnitude or Wanda pruning of one `[I, O]` weight: the `[I, O]` float64 weight with
    the masked entries zeroed.

    Args:
        weight: `[I, O]` float weight.
        scheme: Method "magnitude" or "wanda", and the target.
        norms: `[I]` input norms (`input_norms`), needed by Wanda.
        sparsity: Overrides an unstructured scheme's sparsity (OWL).

    Raises:
        ValueError: Wanda without norms, or another method.
    """
    if scheme.method == "magnitude":
        scores = magnitude_scores(weight)  # [I, O]
    elif scheme.method == "wanda":
        if norms is None:
            raise ValueError("Wanda needs the input norms of the calibration inputs")
        scores = wanda_scores(weight, norms)  # [I, O]
    else:
        raise ValueError(f"prune_matrix does magnitude and wanda, not {scheme.method!r}")
    mask = scheme_mask(scores, scheme, sparsity)  # [I, O]
    return np.where(mask, np.asarray(weight, np.float64), 0.0)  # [I, O]
