"""GPTQ ("GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
arXiv 2210.17323), as METHODS.md section 1 states it.

Per linear layer, layers in forward order, each fed by the already-quantized layers before it:

1. `H = 2/T * sum x x^T` over the T calibration inputs x of the layer (float64 here).
2. Dead inputs (`H_jj == 0`): `H_jj = 1` and weight row j zeroed.
3. Act-order (optional): inputs processed by descending `diag(H)`; undone at the end.
4. Damping: `H += damping * mean(diag H) * I`.
5. `U = cholesky(H^-1)` upper (`H^-1 = U^T U`).
6. Blocks of `block_size` inputs; inside a block, input i in turn: when it is the first of
   its scale group to be processed, the group's scale (and zero point) is computed from the
   group's current, already-updated weights; `q = Quant(w_i)`; `e = (w_i - q) / U_ii`; the
   block's later inputs take `w -= e (x) U[i, i:end]`; after the block, one matmul
   propagates the block's errors to every later input.

Weights are `[I, O]` here (input rows, output columns), the transpose of the paper's
`[out, in]`; "column i" of the paper is input row i. Groups are contiguous runs of
`group_size` input rows, as the storage format (`QuantizedWeight`) needs, also under
act-order; the scale of a group is then computed when act-order first reaches one of its
rows, from that moment's updated weights of all its rows (none of which is quantized yet).
Weights of later rows outside the current block are brought up to date for this (their
pending in-block updates applied) before the scale is taken.

The result is an ordinary `QuantizedWeight` in the scheme's format, so GPTQ and RTN models
share loaders, kernels and checkpoints.

Steps 2-6 are one routine, `error_feedback_sweep`, that takes "what to do with input row i"
as a `ColumnRule`: GPTQ's is `GridRounding` (round it); SparseGPT
(`jaxinfer.prune.sparsegpt`) masks it, or masks it and then rounds it with `GridRounding`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models import Transformer
from jaxinfer.models.hooks import SITES
from jaxinfer.quant.calibration import INPUT_SITE, embedding_output, positions_for, run_block
from jaxinfer.quant.config import QuantizationConfig, WeightScheme
from jaxinfer.quant.linear import LinearSite, copy_model, linear_sites, quantize_tied_head
from pallas_kernels.quant_matmul import QuantizedWeight, WeightFormat, get_format

# Called after each layer with (site, its [T, I] calibration inputs, the float [I, O]
# weight, the GPTQ QuantizedWeight): lets tests and reports measure per-layer errors.
LayerCallback = Callable[[LinearSite, jax.Array, jax.Array, QuantizedWeight], None]


def hessian(inputs: jax.Array) -> np.ndarray:
    """`H = 2/T * X^T X` from `[T, I]` inputs, accumulated in float32 (METHODS.md), returned
    as float64 `[I, I]` for the inversion and Cholesky factorization that follow."""
    x = jnp.asarray(inputs, jnp.float32)  # [T, I]
    product = jnp.matmul(x.T, x, precision=jax.lax.Precision.HIGHEST)  # [I, I]
    return np.asarray(product, np.float64) * (2.0 / x.shape[0])


def _group_parameters(current: np.ndarray, scheme: WeightScheme
                      ) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale `[O]` (and signed zero point `[O]`) of one group's current `[group_size, O]` weights,
    by the same rule as round-to-nearest (the format's `grid_parameters`)."""
    scales, zeros = _grid(scheme).grid_parameters(
        jnp.asarray(current[None], jnp.float32), scheme.bits,
        scheme.symmetric)  # [1, O] each
    return (np.asarray(scales[0], np.float64),
            None if zeros is None else np.asarray(zeros[0], np.float64))


def _grid(scheme: WeightScheme) -> WeightFormat:
    """The scheme's format, which must be on an integer grid for GPTQ to round onto it."""
    weight_format = get_format(scheme.format)
    if weight_format.levels is None:
        raise ValueError(f"GPTQ needs an integer-grid format; {scheme.format} has none")
    return weight_format


@dataclasses.dataclass
class SweepState:
    """What a `ColumnRule` sees of the sweep, in processing order (act-order permuted).

    Attributes:
        weights: `[O, I]` weights; inputs past the current block have not yet received the
            current block's pending updates (`current` applies them).
        upper: `[I, I]` upper Cholesky factor of the damped `H^-1` (`H^-1 = U^T U`).
        order: `[I]` original input index of each processing position.
        position_of: `[I]` processing position of each original input.
        start: First position of the current block.
        end: One past its last position.
        block: `[O, end - start]` the block's weights, updated as the block is walked.
        errors: `[O, end - start]` the scaled errors of the block's inputs done so far.
    """

    weights: np.ndarray
    upper: np.ndarray
    order: np.ndarray
    position_of: np.ndarray
    start: int = 0
    end: int = 0
    block: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0)))
    errors: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0)))

    def current(self, positions: np.ndarray, i: int) -> np.ndarray:
        """`[O, len(positions)]` up-to-date weights at processing `positions` (none of them
        before the block's input `i`), while the block's input `i` is being processed."""
        values = np.empty((self.weights.shape[0], positions.size))  # [O, P]
        inside = positions < self.end  # [P]
        values[:, inside] = self.block[:, positions[inside] - self.start]
        # Later blocks have not yet received this block's pending updates.
        outside = positions[~inside]  # [P - inside.sum()]
        values[:, ~inside] = (self.weights[:, outside] - self.errors[:, :i]
                              @ self.upper[self.start:self.start + i, outside])
        return values


# What the sweep does with the block's input `i` (its updated weights are
# `state.block[:, i]`): returns its `[O]` replacement (rounded, masked, or both).
ColumnRule = Callable[[SweepState, int], np.ndarray]


def error_feedback_sweep(weight: jax.Array | np.ndarray, hessian_matrix: np.ndarray,
                         column_rule: ColumnRule, *, damping: float = 0.01,
                         block_size: int = 128, act_order: bool = False) -> np.ndarray:
    """Steps 2-6 above with "what to do with an input row" left to `column_rule`: GPTQ
    rounds it, SparseGPT (`jaxinfer.prune.sparsegpt`) masks it, or masks then rounds it.

    Each replacement's error `e = (w_i - replacement) / U_ii` is propagated to the inputs
    after it, within the block at once and to later blocks by one matmul per block.

    Args:
        weight: `[I, O]` float weight.
        hessian_matrix: `[I, I]` `2/T X^T X` of the layer's calibration inputs.
        column_rule: Called for each input in processing order (see `ColumnRule`).
        damping: Fraction of the mean diagonal added to the diagonal.
        block_size: Inputs per lazy-batch block.
        act_order: Process inputs by descending Hessian diagonal.

    Returns:
        `[I, O]` float64: every input row's replacement, in the original order. Dead inputs
        (`H_jj == 0`) reach the rule as zeros.
    """
    w = np.asarray(weight, np.float64).T.copy()  # [O, I]: the paper's layout
    h = np.array(hessian_matrix, np.float64)  # [I, I]
    k = w.shape[1]
    dead = np.diag(h) == 0  # [I]
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)  # [I]
    position_of = np.argsort(order)  # [I]: where each original input is processed
    w, h = w[:, order], h[order][:, order]  # [O, I], [I, I] in processing order
    h[np.diag_indices(k)] += damping * np.mean(np.diag(h))
    upper = np.linalg.cholesky(np.linalg.inv(h)).T  # [I, I], H^-1 = U^T U
    state = SweepState(w, upper, order, position_of)
    replaced = np.zeros_like(w)  # [O, I] processing order
    for start in range(0, k, block_size):
        end = min(start + block_size, k)
        state.start, state.end = start, end
        state.block = block = w[:, start:end].copy()  # [O, end - start]: updated as walked
        state.errors = errors = np.zeros_like(block)  # [O, end - start]
        for i in range(end - start):
            column = block[:, i]  # [O]
            replacement = column_rule(state, i)  # [O]
            replaced[:, start + i] = replacement
            error = (column - replacement) / upper[start + i, start + i]  # [O]
            block[:, i:] -= np.outer(error, upper[start + i, start:end][i:])
            errors[:, i] = error
        w[:, end:] -= errors @ upper[start:end, end:]
    return replaced[:, position_of].T  # [I, O] original order


class GridRounding:
    """GPTQ's column rule: rounds each input row onto the scheme's integer grid, taking a
    group's scale (and zero point) when the sweep first reaches one of its rows, from that
    moment's updated weights of all its rows; records the integer levels.

    Called with `keep` (`[O]` bool), entries not kept get the zero point's level, so they
    dequantize to exactly 0 (SparseGPT's joint prune-and-quantize).

    Args:
        scheme: Target format with an integer grid.
        shape: `(I, O)` of the weight.

    Raises:
        ValueError: I is not a multiple of the group size.
    """

    def __init__(self, scheme: WeightScheme, shape: tuple[int, int]) -> None:
        k, n = shape
        self.scheme = scheme
        weight_format = _grid(scheme)
        self.group_size = weight_format.group_rows(k, scheme.group_size)
        if k % self.group_size:
            raise ValueError(f"K={k} is not a multiple of group_size={self.group_size}")
        self.lowest, self.highest = weight_format.levels(scheme.bits, scheme.symmetric)
        num_groups = k // self.group_size
        self.scales = np.zeros((num_groups, n))  # [C, O]
        self.zeros = None if scheme.symmetric else np.zeros((num_groups, n))  # [C, O]
        self.has_parameters = np.zeros(num_groups, bool)  # [C]
        self.levels = np.zeros((k, n))  # [I, O] integer levels, original order

    def __call__(self, state: SweepState, i: int, keep: np.ndarray | None = None
                 ) -> np.ndarray:
        """The `[O]` dequantized replacement of the block's input `i`."""
        original = state.order[state.start + i]
        group = original // self.group_size
        if not self.has_parameters[group]:
            members = state.position_of[group * self.group_size:
                                        (group + 1) * self.group_size]  # [group_size]
            scale, zero = _group_parameters(state.current(members, i).T, self.scheme)
            self.scales[group], self.has_parameters[group] = scale, True
            if self.zeros is not None:
                self.zeros[group] = zero
        scale = self.scales[group]  # [O]
        zero = 0.0 if self.zeros is None else self.zeros[group]  # [O] or scalar
        column = state.block[:, i]  # [O]
        level = np.clip(np.round(column / scale) + zero, self.lowest, self.highest)  # [O]
        if keep is not None:
            level = np.where(keep, level, zero)  # [O]: the grid's exact zero
        self.levels[original] = level
        return (level - zero) * scale  # [O]

    def quantized_weight(self) -> QuantizedWeight:
        """The levels recorded so far with their scales, in the scheme's storage."""
        return _as_quantized_weight(self.levels.astype(np.int8), self.scales, self.zeros,
                                    self.scheme)


def gptq_quantize(weight: jax.Array | np.ndarray, hessian_matrix: np.ndarray,
                  scheme: WeightScheme, *, damping: float = 0.01, block_size: int = 128,
                  act_order: bool = True) -> QuantizedWeight:
    """GPTQ of one `[I, O]` weight given its `[I, I]` Hessian (steps 2-6 above).

    Args:
        weight: `[I, O]` float weight.
        hessian_matrix: `[I, I]` `2/T X^T X` of the layer's calibration inputs.
        scheme: Target format, any with an integer grid in the registry: "int8"/"w8a8"
            (one scale per output channel: the whole I is one group) or "int4" with `bits`
            and `group_size`.
        damping: Fraction of the mean diagonal added to the diagonal.
        block_size: Inputs per lazy-batch block.
        act_order: Process inputs by descending Hessian diagonal.

    Returns:
        The quantized weight in `scheme`'s format.

    Raises:
        ValueError: I is not a multiple of the group size.
    """
    rounding = GridRounding(scheme, tuple(np.shape(weight)))
    error_feedback_sweep(weight, hessian_matrix, rounding, damping=damping,
                         block_size=block_size, act_order=act_order)
    return rounding.quantized_weight()


def _as_quantized_weight(levels: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                         scheme: WeightScheme) -> QuantizedWeight:
    """`[I, O]` integer levels with `[C, O]` scales (zeros) in the scheme's storage."""
    return get_format(scheme.format).from_levels(
        jnp.asarray(levels), jnp.asarray(scales, jnp.float32),
        None if zeros is None else jnp.asarray(zeros, jnp.int8), scheme.group_size,
        scheme.bits)


def gptq_quantize_model(model: Transformer, config: QuantizationConfig, windows: np.ndarray,
                        *, on_layer: LayerCallback | None = None,
                        implementation: str = "auto") -> Transformer:
    """A GPTQ-quantized copy of `model`, layer by layer on calibration windows.

    Within each block the projections are quantized in forward order (q, k, v; o; gate,
    up; down), each group's inputs recaptured after the groups before it were quantized,
    and each block is fed the output of the already-quantized blocks before it. An untied
    LM head, if the rules quantize it, comes last, fed by the quantized model.

    Args:
        model: The float model (left unchanged); dense blocks only.
        config: Rules and GPTQ settings (`gptq_damping`, `gptq_block_size`,
            `gptq_act_order`).
        windows: `[B, T]` calibration token ids.
        on_layer: Called after each layer (see `LayerCallback`).
        implementation: The quantized layers' `pallas_kernels.dispatch` choice.

    Raises:
        ValueError: An MoE model, or a weight whose shape does not fit its scheme.
    """
    model = copy_model(model)
    token_ids = jnp.asarray(windows)  # [B, T]
    positions = positions_for(token_ids)  # [B, T]
    x = embedding_output(model, token_ids)  # [B, T, D]
    sites = linear_sites(model)
    for index, block in enumerate(model.layers):
        block_sites = [site for site in sites if site.path.startswith(f"layers.{index}.")]
        for capture in SITES:
            group = [site for site in block_sites if INPUT_SITE[site.name] == capture]
            chosen = [(site, config.scheme_for(site.path)) for site in group]
            chosen = [(site, scheme) for site, scheme in chosen if scheme is not None]
            if not chosen:
                continue
            _, inputs = run_block(block, x, positions)  # with the layers quantized so far
            h = hessian(inputs[capture])  # [I, I]
            for site, scheme in chosen:
                _quantize_site(site, scheme, h, inputs[capture], config, on_layer,
                               implementation)
        x, _ = run_block(block, x, positions)  # [B, T, D] from the quantized block
    head = [site for site in sites if site.path == "lm_head"]
    if head and config.scheme_for("lm_head") is not None:
        hidden, _ = model.hidden_states(token_ids, positions)  # [B, T, D]
        inputs = hidden.reshape(-1, hidden.shape[-1])  # [B * T, D]
        _quantize_site(head[0], config.scheme_for("lm_head"), hessian(inputs), inputs,
                       config, on_layer, implementation)
    quantize_tied_head(model, config, implementation)
    return model


def _quantize_site(site: LinearSite, scheme: WeightScheme, h: np.ndarray, inputs: jax.Array,
                   config: QuantizationConfig, on_layer: LayerCallback | None,
                   implementation: str) -> None:
    matrix = site.float_matrix()  # [I, O]
    try:
        weight = gptq_quantize(matrix, h, scheme, damping=config.gptq_damping,
                               block_size=config.gptq_block_size,
                               act_order=config.gptq_act_order)
    except ValueError as error:
        raise ValueError(f"{site.path}: {error}") from None
    if on_layer is not None:
        on_layer(site, inputs, matrix, weight)
    site.quantize(weight, implementation)
