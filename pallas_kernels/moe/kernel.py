"""Pallas TPU grouped matmul for mixture-of-experts: rows sorted by expert, one weight per group.

`lhs [rows, I]` holds rows sorted by expert; expert e owns `group_sizes[e]` consecutive rows and
multiplies them by `rhs[e]`. A row tile of `block_m` rows can straddle several groups (and a
group can span many tiles), so the kernel does not map tiles to experts one-to-one. Instead the
wrapper turns `group_sizes` into a *visit schedule*: the list of (row tile, expert) pairs whose
rows intersect, in row order. The grid is `(O tiles, visits, I tiles)`; each visit multiplies the
row tile, with the rows outside the expert's group zeroed, by that expert's weight block and adds
the product into an f32 VMEM accumulator that stays live across all visits of the same tile.
The tile is written once, on the last I step of its last visit.

The schedule has a static length, `row_tiles + E - 1` (every group boundary inside a tile adds at
most one visit); unused trailing entries are marked invalid, skip all work, and repeat the last
tile and expert, so the finished output tile stays put and no new expert's weights are fetched.
Tiles past the last group (padding, or `sum(group_sizes) < rows`) get one compute-free visit that
writes zeros, matching `jax.lax.ragged_dot`. Empty groups get no visits.

The schedule and the group offsets (the prefix sums of `group_sizes`) are scalar-prefetched into
SMEM, where the index maps read them to pick the lhs row tile and the expert's weight block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Bits of the per-visit flags word.
_COMPUTE = 1  # the visit multiplies (clear for zero-fill visits and unused schedule entries)
_FIRST = 2  # first visit of its row tile: zero the accumulator
_LAST = 4  # last visit of its row tile: write the accumulator out


def _fit_block(block: int, dim: int, name: str) -> int:
    """Clamps a block to its dimension and checks that it tiles the dimension exactly."""
    if block <= 0:
        raise ValueError(f"{name} must be positive, got {block}")
    if dim <= block:
        return dim
    if dim % block:
        raise ValueError(f"{name}={block} does not divide the dimension {dim}")
    return block


def visit_schedule(group_sizes: jax.Array, num_rows: int, num_padded_rows: int,
                   block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The (row tile, expert) visits the kernel makes, computed from the group sizes.

    Args:
        group_sizes: `[E]` int32 rows per expert; their sum should not exceed `num_rows`
            (a larger sum is clipped, so rows past `num_rows` belong to no group).
        num_rows: The real number of lhs rows.
        num_padded_rows: rows rounded up to a multiple of `block_m`.
        block_m: Rows per tile.

    Returns:
        `(offsets [E+1], tiles, experts, flags [num_slots])`, all int32, with
        `num_slots = num_padded_rows // block_m + E - 1`: expert e owns rows
        `offsets[e]:offsets[e+1]`; visit v works on row tile `tiles[v]` with expert
        `experts[v]`, and `flags[v]` holds the `_COMPUTE`, `_FIRST` and `_LAST` bits.
    """
    num_experts = group_sizes.shape[0]
    num_tiles = num_padded_rows // block_m
    num_slots = num_tiles + num_experts - 1
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)  # [E]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [E]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # [E+1]
    first_tile = starts // block_m  # [E]
    # Empty groups visit nothing; (ends - 1) // block_m is meaningless for them.
    tiles_per_group = jnp.where(ends > starts, (ends - 1) // block_m - first_tile + 1, 0)  # [E]
    group_visit_end = jnp.cumsum(tiles_per_group)  # [E]
    group_visit_start = group_visit_end - tiles_per_group  # [E]
    num_group_visits = group_visit_end[-1]
    covered_tiles = (ends[-1] + block_m - 1) // block_m  # tiles holding at least one grouped row
    num_visits = num_group_visits + (num_tiles - covered_tiles)  # >= 1 since num_tiles >= 1

    slot = jnp.arange(num_slots, dtype=jnp.int32)  # [num_slots]
    # The group of visit v is the first whose visit range ends after v (skips empty groups).
    group = jnp.minimum(jnp.searchsorted(group_visit_end, slot, side="right"),
                        num_experts - 1).astype(jnp.int32)  # [num_slots]
    is_group_visit = slot < num_group_visits  # [num_slots]
    tiles = jnp.where(is_group_visit, first_tile[group] + slot - group_visit_start[group],
                      covered_tiles + slot - num_group_visits)  # [num_slots]
    # Zero-fill visits use the last expert: its rows all lie before the uncovered tiles anyway.
    experts = jnp.where(is_group_visit, group, num_experts - 1)  # [num_slots]
    valid = slot < num_visits  # [num_slots]
    last_valid = num_visits - 1
    tiles = jnp.where(valid, tiles, tiles[last_valid]).astype(jnp.int32)  # [num_slots]
    experts = jnp.where(valid, experts, experts[last_valid]).astype(jnp.int32)  # [num_slots]
    previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tiles[:-1]])  # [num_slots]
    following = jnp.concatenate([tiles[1:], jnp.full((1,), -1, jnp.int32)])  # [num_slots]
    first = valid & (tiles != previous)  # [num_slots]
    last = valid & ((slot == last_valid) | (tiles != following))  # [num_slots]
    flags = (jnp.where(is_group_visit & valid, _COMPUTE, 0) + jnp.where(first, _FIRST, 0) +
             jnp.where(last, _LAST, 0)).astype(jnp.int32)  # [num_slots]
    return offsets.astype(jnp.int32), tiles, experts, flags


def _grouped_matmul_kernel(offsets_ref, tiles_ref, experts_ref, flags_ref, lhs_ref, rhs_ref,
                           *rest, block_m: int, quantized: bool):
    """One (O tile, visit, I tile) step; `rest` is `([scales_ref,] out_ref, acc_ref)`."""
    if quantized:
        scales_ref, out_ref, acc_ref = rest
    else:
        scales_ref = None
        out_ref, acc_ref = rest
    visit = pl.program_id(1)
    k_step = pl.program_id(2)
    flags = flags_ref[visit]

    @pl.when((k_step == 0) & ((flags & _FIRST) != 0))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((flags & _COMPUTE) != 0)
    def _accumulate():
        expert = experts_ref[visit]
        rows = tiles_ref[visit] * block_m + jax.lax.broadcasted_iota(
            jnp.int32, (block_m, 1), 0)  # [bm, 1] global row ids
        in_group = (rows >= offsets_ref[expert]) & (rows < offsets_ref[expert + 1])  # [bm, 1]
        # Zeroing the other experts' rows makes their contribution exactly zero, so several
        # experts can accumulate into the same tile without a read-modify-write per row.
        lhs = jnp.where(in_group, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))  # [bm, bk]
        rhs = rhs_ref[...]  # [bk, bn]
        if quantized:
            # int8 values are exact in bf16/f32; the per-output-channel scale commutes with the
            # I sum, so it is applied to the partial product instead of to every weight.
            rhs = rhs.astype(lhs.dtype)  # [bk, bn]
        product = jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)  # [bm, bn]
        if quantized:
            product = product * scales_ref[...].astype(jnp.float32)  # [bm, bn] * [1, bn]
        acc_ref[...] += product

    @pl.when((k_step == pl.num_programs(2) - 1) & ((flags & _LAST) != 0))
    def _write():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _grouped_matmul_call(lhs: jax.Array, rhs: jax.Array, scales: jax.Array | None,
                         group_sizes: jax.Array, *, block_m: int, block_k: int, block_n: int,
                         interpret: bool | pltpu.InterpretParams) -> jax.Array:
    num_rows, depth = lhs.shape
    num_experts, rhs_depth, width = rhs.shape
    if rhs_depth != depth:
        raise ValueError(f"lhs is [M, {depth}] but rhs is [E, {rhs_depth}, N]")
    if group_sizes.shape != (num_experts,):
        raise ValueError(f"group_sizes must be [{num_experts}], got {group_sizes.shape}")
    if num_rows == 0:
        return jnp.zeros((0, width), lhs.dtype)
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    block_k = _fit_block(block_k, depth, "block_k")
    block_n = _fit_block(block_n, width, "block_n")
    # Pad the rows up to whole tiles; the padding rows belong to no group and come back as zeros.
    block_m = min(block_m, num_rows)
    num_padded_rows = pl.cdiv(num_rows, block_m) * block_m
    lhs_padded = jnp.pad(lhs, ((0, num_padded_rows - num_rows), (0, 0)))  # [rows', I]
    offsets, tiles, experts, flags = visit_schedule(group_sizes, num_rows, num_padded_rows,
                                                    block_m)  # [E+1], [num_slots] x 3
    num_visits = tiles.shape[0]

    in_specs = [
        pl.BlockSpec((block_m, block_k), lambda n, v, k, offs, tls, exps, flg: (tls[v], k)),
        pl.BlockSpec((pl.squeezed, block_k, block_n),
                     lambda n, v, k, offs, tls, exps, flg: (exps[v], k, n)),
    ]
    operands = [lhs_padded, rhs]
    if scales is not None:
        in_specs.append(pl.BlockSpec((pl.squeezed, 1, block_n),
                                     lambda n, v, k, offs, tls, exps, flg: (exps[v], 0, n)))
        operands.append(scales.reshape(num_experts, 1, width))  # [E, 1, O]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(width // block_n, num_visits, depth // block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n),
                               lambda n, v, k, offs, tls, exps, flg: (tls[v], n)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
    )
    itemsize = jnp.dtype(lhs.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * num_rows * depth * width,
        transcendentals=0,
        bytes_accessed=(num_rows * depth * itemsize * (width // block_n) + rhs.size *
                        jnp.dtype(rhs.dtype).itemsize + num_rows * width * itemsize))
    out = pl.pallas_call(
        functools.partial(_grouped_matmul_kernel, block_m=block_m,
                          quantized=scales is not None),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_padded_rows, width), lhs.dtype),
        # O tiles are independent; visits and I steps share the accumulator, so they are
        # sequential ("arbitrary").
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(offsets, tiles, experts, flags, *operands)  # [rows', O]
    return out[:num_rows]


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "block_n", "interpret"))
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block_m: int,
                   block_k: int, block_n: int,
                   interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """Grouped matmul: row `i` of group e is `lhs[i] @ rhs[e]`, accumulated in f32.

    Args:
        lhs: `[rows, I]` rows sorted by group.
        rhs: `[E, I, O]` one weight matrix per group.
        group_sizes: `[E]` int32; group e owns `group_sizes[e]` consecutive rows (zero is
            allowed). Rows past `sum(group_sizes)` come back as zeros.
        block_m: Rows per tile (the rows are padded up to a multiple; clamped to them).
        block_k: Contraction tile; clamped to I, else must divide I.
        block_n: Output-column tile; clamped to O, else must divide O.
        interpret: `pallas_call`'s `interpret=` (False compiles with Mosaic for TPU).

    Returns:
        `[rows, O]` in the dtype of `lhs`.

    Raises:
        ValueError: Mismatched shapes or a block that does not tile its dimension.
    """
    return _grouped_matmul_call(lhs, rhs, None, group_sizes, block_m=block_m, block_k=block_k,
                                block_n=block_n, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "block_n", "interpret"))
def grouped_matmul_int8(lhs: jax.Array, rhs: jax.Array, scales: jax.Array,
                        group_sizes: jax.Array, *, block_m: int, block_k: int, block_n: int,
                        interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """Grouped matmul with int8 weights: row `i` of group e is `lhs[i] @ (rhs[e] * scales[e])`.

    The weights stay int8 in HBM and are widened in VMEM; the per-channel scale multiplies the
    f32 partial product of each I tile.

    Args:
        lhs: `[rows, I]` rows sorted by group (float).
        rhs: `[E, I, O]` int8 weights.
        scales: `[E, O]` per-expert, per-output-channel dequantization scales.
        group_sizes: `[E]` int32 rows per group, as in `grouped_matmul`.
        block_m: Rows per tile.
        block_k: Contraction tile.
        block_n: Output-column tile.
        interpret: `pallas_call`'s `interpret=`.

    Returns:
        `[rows, O]` in the dtype of `lhs`.

    Raises:
        ValueError: Mismatched shapes or a block that does not tile its dimension.
    """
    if rhs.dtype != jnp.int8:
        raise ValueError(f"rhs must be int8, got {rhs.dtype}")
    if scales.shape != (rhs.shape[0], rhs.shape[2]):
        raise ValueError(f"scales must be [{rhs.shape[0]}, {rhs.shape[2]}], got {scales.shape}")
    return _grouped_matmul_call(lhs, rhs, scales, group_sizes, block_m=block_m,
                                block_k=block_k, block_n=block_n, interpret=interpret)
