"""SparseGPT (Frantar & Alistarh, ICML 2023, arXiv 2301.00774), as METHODS.md section 7
states it: GPTQ's machinery with pruning in place of rounding.

One routine does both: `jaxinfer.quant.gptq.error_feedback_sweep` builds the damped
Hessian's inverse Cholesky factor U, walks the inputs in blocks of B and propagates each
input's error `e = (w - replacement) / U_ii` to the later inputs; SparseGPT's column rule
here chooses the mask and zeroes the masked weights:

- unstructured, sparsity p: when a block of B inputs starts, per output the block's
  lowest `w^2 / U_jj^2` (of the block's weights as updated so far) are masked; the count
  per block is `round(p * end) - round(p * start)`, so every output ends with exactly
  `round(p * I)` zeros;
- N:M: at every M-th input, per output, the N lowest `w^2 / U_jj^2` of the next M inputs.

Inputs are processed in their order (no act-order: an N:M group must stay M consecutive
inputs). With a quantization scheme the survivors are rounded in the same pass by GPTQ's
own rule (`GridRounding`), which puts every masked entry on the grid's exact zero, so the
result is a `QuantizedWeight` whose pruned entries dequantize to exactly 0.

Weights are `[I, O]`; inside the sweep they are the paper's `[O, I]`.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxinfer.prune.config import PruningScheme
from jaxinfer.quant.config import WeightScheme
from jaxinfer.quant.gptq import GridRounding, SweepState, error_feedback_sweep
from pallas_kernels.quant_matmul import QuantizedWeight


class SparseGPTMask:
    """SparseGPT's column rule: masks each input row as the module docstring says, then
    zeroes the masked entries, or hands the row to `rounding` with the mask.

    Args:
        scheme: The target (sparsity or N:M); its method is not looked at.
        shape: `(I, O)` of the weight.
        block_size: The sweep's block B.
        rounding: GPTQ's rule, for joint pruning + quantization; None keeps float values.
        sparsity: Overrides an unstructured scheme's sparsity (OWL).

    Raises:
        ValueError: An N:M pattern whose M does not divide I and B.
    """

    def __init__(self, scheme: PruningScheme, shape: tuple[int, int], block_size: int,
                 rounding: GridRounding | None = None, sparsity: float | None = None) -> None:
        k, n = shape
        self.pattern = scheme.pattern
        self.sparsity = scheme.sparsity if sparsity is None else sparsity
        if self.pattern is not None:
            m = self.pattern[1]
            if k % m or block_size % m:
                raise ValueError(f"{self.pattern[0]}:{m} needs M={m} to divide I={k} and the "
                                 f"block size {block_size}")
        self.rounding = rounding
        self.keep = np.ones((n, k), bool)  # [O, I] the chosen mask, paper layout

    def __call__(self, state: SweepState, i: int) -> np.ndarray:
        """The `[O]` replacement of the block's input `i` (masked, maybe rounded)."""
        position = state.start + i
        if self.pattern is None and i == 0:
            self._choose(state, 0, state.end - state.start,
                         round(self.sparsity * state.end) - round(self.sparsity * state.start))
        elif self.pattern is not None and i % self.pattern[1] == 0:
            self._choose(state, i, i + self.pattern[1], self.pattern[0])
        keep = self.keep[:, position]  # [O]
        if self.rounding is not None:
            return self.rounding(state, i, keep)
        return np.where(keep, state.block[:, i], 0.0)  # [O]

    def _choose(self, state: SweepState, first: int, last: int, count: int) -> None:
        """Masks, per output, the `count` lowest `w^2 / U_jj^2` of the block's inputs
        `first .. last - 1`."""
        if count == 0:
            return
        diagonal = np.diag(state.upper)[state.start + first:state.start + last]  # [L]
        scores = np.square(state.block[:, first:last]) / np.square(diagonal)  # [O, L]
        lowest = np.argsort(scores, axis=1, kind="stable")[:, :count]  # [O, count]
        window = self.keep[:, state.start + first:state.start + last]  # [O, L] view
        np.put_along_axis(window, lowest, False, axis=1)


def sparsegpt_prune(weight: jax.Array | np.ndarray, hessian_matrix: np.ndarray,
                    scheme: PruningScheme, *, damping: float = 0.01, block_size: int = 128,
                    sparsity: float | None = None) -> np.ndarray:
    """SparseGPT of one `[I, O]` weight given its `[I, I]` Hessian `2/T X^T X`.

    Args:
        weight: `[I, O]` float weight.
        hessian_matrix: `[I, I]` Hessian of the layer's calibration inputs.
        scheme: Sparsity or N:M target.
        damping: Fraction of the mean diagonal added to the diagonal.
        block_size: B: inputs per block (mask choice and lazy updates).
        sparsity: Overrides an unstructured scheme's sparsity (OWL).

    Returns:
        `[I, O]` float64: the pruned weight with its survivors updated.
    """
    rule = SparseGPTMask(scheme, tuple(np.shape(weight)), block_size, sparsity=sparsity)
    return error_feedback_sweep(weight, hessian_matrix, rule, damping=damping,
                                block_size=block_size, act_order=False)


def sparsegpt_prune_quantize(weight: jax.Array | np.ndarray, hessian_matrix: np.ndarray,
                             scheme: PruningScheme, quantization: WeightScheme, *,
                             damping: float = 0.01, block_size: int = 128,
                             sparsity: float | None = None) -> QuantizedWeight:
    """Joint SparseGPT + GPTQ of one `[I, O]` weight: masks as `sparsegpt_prune`, rounds the
    survivors in the same pass; masked entries dequantize to exactly 0.

    Args:
        weight: `[I, O]` float weight.
        hessian_matrix: `[I, I]` Hessian of the layer's calibration inputs.
        scheme: Sparsity or N:M target.
        quantization: Format with an integer grid ("int8", "int4" with bits and group size).
        damping: Fraction of the mean diagonal added to the diagonal.
        block_size: B: inputs per block.
        sparsity: Overrides an unstructured scheme's sparsity (OWL).

    Raises:
        ValueError: I is not a multiple of the group size or of M.
    """
    shape = tuple(np.shape(weight))
    rounding = GridRounding(quantization, shape)
    rule = SparseGPTMask(scheme, shape, block_size, rounding=rounding, sparsity=sparsity)
    error_feedback_sweep(weight, hessian_matrix, rule, damping=damping,
                         block_size=block_size, act_order=False)
    return rounding.quantized_weight()
