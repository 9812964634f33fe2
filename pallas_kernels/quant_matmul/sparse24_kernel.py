"""Pallas TPU kernel for 2:4 sparse weights: each compressed tile is expanded in VMEM, then a dot.

The weight layout is `sparse24.py`'s: planar kept values (float, int8 or nibble-packed int4)
and a positions byte holding one group of each half of I. The grid is
`(T' // block_m, O // block_n, I // (8 * block_groups))`; step `kk` of the reduction axis
covers `block_groups` groups of 4 input rows in each half of I (input rows
`4 * kk * block_groups ...` and the same plus I / 2), so one `[block_groups, block_n]`
positions tile serves both halves and every array is read in whole tiles.

Expansion without row shuffles: the dense tile's row `4g + p` (group g, position p) is the
kept value whose position is p, or zero. The kernel builds, for each half h and position
p, the `[block_groups, block_n]` plane of rows `4g + p` with two selects, and multiplies it
by the matching columns of x; the wrapper reorders x once per call (small next to the
weight in decode) so those columns are one contiguous slice: `x_planes[h, :, p * G + g]` is
column `h * I / 2 + 4 * (kk * G + g) + p`. Eight `[block_m, G] x [G, block_n]` dots per
step do the dense tile's FLOPs: TPUs have no sparse matrix unit, the gain is the bytes read
from HBM (about half of bf16's, see `sparse24.py`).

Value kinds:
    float  bf16 / f32 kept values, upcast in VMEM.
    int8   per-output-channel scales, applied to the accumulator once at the end.
    int4   nibbles unpacked with bit operations and scaled per group of `group_size` input
           rows (a block holds whole groups) before the planes are built.

Float paths compute in float32 so they agree with the references to float32 rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quant_matmul import sparse24, tuning

_HIGHEST = jax.lax.Precision.HIGHEST
_COMPILER_PARAMS = pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel", "arbitrary"))
# Groups per half of I per step: 128 makes every x plane a whole 128-lane tile (1024 input
# rows per step) and a positions tile a whole number of 32-row uint8 tiles.
PREFERRED_BLOCK_GROUPS = 128
VALUE_KINDS = ("float", "int8", "int4")


def _planes(positions: jax.Array, first: jax.Array, second: jax.Array) -> list[jax.Array]:
    """The 4 dense planes (rows 4g + p, p = 0..3) of one half's groups, each `[G, block_n]`."""
    first_position, second_position = positions & 3, positions >> 2  # [G, block_n] each
    zero = jnp.zeros_like(first)
    return [jnp.where(first_position == p, first, jnp.where(second_position == p, second, zero))
            for p in range(sparse24.GROUP)]


def _sparse24_kernel(x_ref, values_ref, positions_ref, *rest, kind: str, block_groups: int):
    if kind == "float":
        (out_ref, accumulator_ref), scales_ref = rest, None
    else:
        scales_ref, out_ref, accumulator_ref = rest
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _zero():
        accumulator_ref[...] = jnp.zeros_like(accumulator_ref)

    # Bit operations on int32: narrow integer vector ops lower poorly on older TPUs.
    packed_positions = positions_ref[...].astype(jnp.int32)  # [G, block_n]
    for half in range(2):
        positions = (packed_positions >> (4 * half)) & 0xF  # [G, block_n]
        if kind == "int4":
            nibbles = values_ref[half].astype(jnp.int32)  # [G, block_n]
            first = (((nibbles & 0xF) ^ 8) - 8).astype(jnp.float32)  # [G, block_n]
            second = (((nibbles >> 4) ^ 8) - 8).astype(jnp.float32)  # [G, block_n]
            scales = scales_ref[half]  # [G * 4 / group_size, block_n]
            groups_per_scale = block_groups // scales.shape[0]
            first, second = (
                (kept.reshape(scales.shape[0], groups_per_scale, -1) * scales[:, None, :]
                 ).reshape(block_groups, -1) for kept in (first, second))
        else:
            first = values_ref[0, half].astype(jnp.float32)  # [G, block_n]
            second = values_ref[1, half].astype(jnp.float32)  # [G, block_n]
        x = x_ref[half].astype(jnp.float32)  # [block_m, 4 * G]
        for position, plane in enumerate(_planes(positions, first, second)):
            columns = x[:, position * block_groups:(position + 1) * block_groups]  # [block_m, G]
            accumulator_ref[...] += jnp.dot(columns, plane, precision=_HIGHEST,
                                            preferred_element_type=jnp.float32)

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _write():
        result = accumulator_ref[...]  # [block_m, block_n]
        if kind == "int8":
            result = result * scales_ref[...]
        out_ref[...] = result.astype(out_ref.dtype)


def default_block_groups(k: int, group_size: int | None = None) -> int:
    """Groups per half of I per step: `PREFERRED_BLOCK_GROUPS` (a multiple of the int4 scale
    group's groups of 4, so a block holds whole scale groups), or all I / 8 when that does
    not divide them (a block spanning a whole dimension is always legal)."""
    half_groups = k // (2 * sparse24.GROUP)
    multiple = PREFERRED_BLOCK_GROUPS
    if group_size:
        multiple = math.lcm(multiple, group_size // sparse24.GROUP)
    return multiple if half_groups % multiple == 0 else half_groups


def _split_x(x: jax.Array, block_groups: int) -> jax.Array:
    """`[T, I]` to `[2, T, I / 2]`: the halves of I, each block's columns reordered from
    (group, position) to (position, group), so each position's columns are contiguous."""
    m, k = x.shape
    halves = x.reshape(m, 2, k // 2).swapaxes(0, 1)  # [2, T, I/2]
    blocks = halves.reshape(2, m, k // (8 * block_groups), block_groups, sparse24.GROUP)
    return blocks.swapaxes(3, 4).reshape(2, m, k // 2)  # [2, T, I/2]


def _pad_rows(x: jax.Array, block_m: int) -> jax.Array:
    """Pads the token axis of `[T, I]` x up to a multiple of `block_m` with zeros."""
    padding = tuning.round_up(x.shape[0], block_m) - x.shape[0]
    return jnp.pad(x, ((0, padding), (0, 0))) if padding else x


@functools.partial(jax.jit, static_argnames=("kind", "group_size", "block_m", "block_n",
                                             "block_groups", "out_dtype", "interpret"))
def sparse24_matmul(
    x: jax.Array,
    values: jax.Array,
    positions: jax.Array,
    scales: jax.Array | None = None,
    *,
    kind: str,
    group_size: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_groups: int | None = None,
    out_dtype: jnp.dtype | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`x @ W` for a compressed 2:4 sparse weight W (layout: `sparse24.py`).

    Args:
        x: `[T, I]` float32 or bfloat16 activations.
        values: Kept values: `[I // 2, O]` bf16 / f32 ("float") or int8 ("int8"), or
            `[I // 4, O]` uint8 nibble pairs ("int4").
        positions: `[I // 8, O]` uint8.
        scales: None ("float"), `[O]` float32 ("int8") or `[I // group_size, O]` ("int4").
        kind: "float", "int8" or "int4".
        group_size: Input rows per int4 scale; a multiple of 4 such that a block holds
            whole groups.
        block_m, block_n: Token and output blocks; unset ones come from `tuning.py`.
        block_groups: Groups of 4 input rows per half of I per step (`default_block_groups`
            when unset).
        out_dtype: Result dtype; defaults to the dtype of `x`.
        interpret: `pallas_call`'s interpret argument.

    Returns:
        `[T, O]`.

    Raises:
        ValueError: Mismatched shapes, or blocks that do not divide the weight.
    """
    if kind not in VALUE_KINDS:
        raise ValueError(f"sparse24 matmul: kind must be one of {VALUE_KINDS}, got {kind!r}")
    stored_k, n = positions.shape
    k = 8 * stored_k
    sparse24.check_shape(k)
    rows_per_value_row = 4 if kind == "int4" else 2
    if values.shape != (k // rows_per_value_row, n) or x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"sparse24 {kind} matmul: x {x.shape}, values {values.shape} and "
                         f"positions {positions.shape} do not describe [M, {k}] x [{k}, {n}]")
    half_groups = k // 8
    block_groups = block_groups or default_block_groups(k, group_size)
    m = x.shape[0]
    default_m, default_n, _ = tuning.default_block_sizes("sparse24", m, k, n)
    block_m, block_n = block_m or default_m, block_n or default_n
    if half_groups % block_groups or n % block_n:
        raise ValueError(f"sparse24 matmul: block_groups={block_groups} must divide I / 8 = "
                         f"{half_groups} and block_n={block_n} must divide O={n}")
    steps = half_groups // block_groups
    x_planes = _split_x(_pad_rows(x, block_m), block_groups)  # [2, T', I/2]
    m_padded = x_planes.shape[1]
    in_specs = [pl.BlockSpec((2, block_m, 4 * block_groups), lambda i, j, kk: (0, i, kk))]
    if kind == "int4":
        operands = [values.reshape(2, half_groups, n)]  # [half, I/8, O]
        in_specs.append(pl.BlockSpec((2, block_groups, block_n), lambda i, j, kk: (0, kk, j)))
    else:
        operands = [values.reshape(2, 2, half_groups, n)]  # [slot, half, I/8, O]
        in_specs.append(pl.BlockSpec((2, 2, block_groups, block_n),
                                     lambda i, j, kk: (0, 0, kk, j)))
    operands.append(positions)  # [I/8, O]
    in_specs.append(pl.BlockSpec((block_groups, block_n), lambda i, j, kk: (kk, j)))
    if kind == "int8":
        if scales is None or scales.shape != (n,):
            raise ValueError(f"sparse24 int8 matmul: scales must be [{n}]")
        operands.append(scales.astype(jnp.float32).reshape(1, n))  # [1, O]
        in_specs.append(pl.BlockSpec((1, block_n), lambda i, j, kk: (0, j)))
    elif kind == "int4":
        if (not group_size or group_size % sparse24.GROUP
                or (sparse24.GROUP * block_groups) % group_size
                or scales is None or scales.shape != (k // group_size, n)):
            raise ValueError(f"sparse24 int4 matmul: group_size={group_size} must be a multiple "
                             f"of 4 dividing a block's {sparse24.GROUP * block_groups} input "
                             f"rows per half, with scales [I / group_size, O]")
        scale_rows = sparse24.GROUP * block_groups // group_size
        # [half, step, C per block, O]: a block's scale rows are a whole (full-size)
        # second-minor dimension, a legal block even below the 8-row sublane tile.
        operands.append(scales.astype(jnp.float32).reshape(2, steps, scale_rows, n))
        in_specs.append(pl.BlockSpec((2, pl.Squeezed(), scale_rows, block_n),
                                     lambda i, j, kk: (0, kk, 0, j)))
    out = pl.pallas_call(
        functools.partial(_sparse24_kernel, kind=kind, block_groups=block_groups),
        out_shape=jax.ShapeDtypeStruct((m_padded, n), out_dtype or x.dtype),
        grid=(m_padded // block_m, n // block_n, steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
        name=f"sparse24_{kind}_matmul",
    )(x_planes, *operands)  # [T', O]
    return out[:m]  # [T, O]

