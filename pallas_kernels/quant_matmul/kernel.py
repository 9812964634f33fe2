"""Pallas TPU kernels for weight-quantized matmuls: int8, grouped int4, grouped int8 and W8A8.

Each kernel runs a `(T' // block_m, O // block_n, I // block_k)` grid. The two output axes
are independent ("parallel", so megacore chips may split them); the I axis is a reduction
("arbitrary"): every step along I adds one `[block_m, block_n]` partial product into a VMEM
scratch accumulator, zeroed on the first step and written to the output on the last, so
the output block leaves VMEM once.

    int8   activations (f32/bf16) times int8 weights; the per-output-channel scale is
           constant along I, so it multiplies the accumulator once at the end instead of
           every weight tile.
    int4   the packed weight tile is unpacked and dequantized (group-wise scales and
           optional zero points, int8 or float) inside the kernel, one block of I at a time;
           a block holds whole groups, or lies inside one group when groups are larger than a
           block.
    int8_grouped  the int4 kernel without the unpacking: int8 tiles scaled group by group
           (GGUF's Q8_0: a scale per 32 rows), sharing its wrapper and block rules.
    w8a8   activations are quantized per token in the wrapper (a token's scale needs its
           whole row, which no single block of I sees); int8 times int8 accumulates exactly
           in int32 and is rescaled on the last step. TPU v4's MXU has no int8 x int8 mode
           (Mosaic rejects the int8 dot there); on such a chip the kernel multiplies the int8
           values as bf16 with f32 sums, which is still exact (see `_w8a8_kernel`).

Float paths compute in float32 (bf16 activations are upcast in VMEM) so they agree with
`reference.py` to float32 rounding. Ragged T is padded in the wrapper and sliced off the
result; I and O must be multiples of their blocks (weights are laid out once, at load
time, so a mismatch is a configuration error and raises ValueError).

Every wrapper takes `interpret=`: False for the compiled kernel, or True /
`pltpu.InterpretParams(...)` for TPU interpret mode on any backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quant_matmul import reference, tuning

_HIGHEST = jax.lax.Precision.HIGHEST
_COMPILER_PARAMS = pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel", "arbitrary"))
_STATIC = ("block_m", "block_n", "block_k", "out_dtype", "interpret")


def _resolve_blocks(
    weight_format: str,
    m: int,
    k: int,
    n: int,
    blocks: tuple[int | None, int | None, int | None],
    group_size: int | None = None,
) -> tuple[int, int, int]:
    """Fills unset block sizes from `tuning.py` and checks I and O against their blocks."""
    defaults = tuning.default_block_sizes(weight_format, m, k, n, group_size)
    block_m, block_n, block_k = (given or default for given, default in zip(blocks, defaults))
    if k % block_k:
        raise ValueError(f"{weight_format} matmul: K={k} (x shape [{m}, {k}]) is not a "
                         f"multiple of block_k={block_k}")
    if n % block_n:
        raise ValueError(f"{weight_format} matmul: N={n} (weight shape [{k}, {n}]) is not a "
                         f"multiple of block_n={block_n}")
    return block_m, block_n, block_k


def _check_inner_dimension(weight_format: str, x: jax.Array, weight_k: int, n: int) -> None:
    if x.ndim != 2 or x.shape[1] != weight_k:
        raise ValueError(f"{weight_format} matmul: x has shape {x.shape}, expected [M, {weight_k}] "
                         f"to match a [{weight_k}, {n}] weight")


def _pad_rows(array: jax.Array, block_m: int, value: float = 0) -> jax.Array:
    """Pads the token axis up to a multiple of `block_m`; the extra rows are sliced off."""
    padding = tuning.round_up(array.shape[0], block_m) - array.shape[0]
    if not padding:
        return array
    return jnp.pad(array, ((0, padding), (0, 0)), constant_values=value)


def _grid(m_padded: int, n: int, k: int, block_m: int, block_n: int, block_k: int):
    return (m_padded // block_m, n // block_n, k // block_k)


# --- int8 weights, float activations -------------------------------------------------------


def _int8_kernel(x_ref, weight_ref, scales_ref, out_ref, accumulator_ref):
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _zero():
        accumulator_ref[...] = jnp.zeros_like(accumulator_ref)

    x = x_ref[...].astype(jnp.float32)  # [block_m, block_k]
    weight = weight_ref[...].astype(jnp.float32)  # [block_k, block_n], exact: |int8| < 2**24
    accumulator_ref[...] += jnp.dot(x, weight, precision=_HIGHEST,
                                    preferred_element_type=jnp.float32)  # [block_m, block_n]

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _write():
        out_ref[...] = (accumulator_ref[...] * scales_ref[...]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def int8_matmul(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    out_dtype: jnp.dtype | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`x @ (values * scales)` with int8 weights and per-output-channel scales.

    Args:
        x: `[T, I]` float32 or bfloat16 activations.
        values: `[I, O]` int8 weights.
        scales: `[O]` float32 per-output-channel scales.
        block_m, block_n, block_k: Block sizes; unset ones come from `tuning.py`.
        out_dtype: Result dtype; defaults to the dtype of `x`.
        interpret: `pallas_call`'s interpret argument.

    Returns:
        `[T, O]`.

    Raises:
        ValueError: Mismatched shapes, or I / O not multiples of block_k / block_n.
    """
    k, n = values.shape
    _check_inner_dimension("int8", x, k, n)
    return per_channel_call(_int8_kernel, "int8", x, values, scales,
                            (block_m, block_n, block_k), out_dtype or x.dtype, interpret)


def per_channel_call(
    kernel_body: Callable[..., None],
    weight_format: str,
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array,
    blocks: tuple[int | None, int | None, int | None],
    out_dtype: jnp.dtype,
    interpret: bool | pltpu.InterpretParams,
) -> jax.Array:
    """The `pallas_call` of a format with one scale per output column (int8, fp8): grid
    `(T' // block_m, O // block_n, I // block_k)`, the output axes parallel, I reduced into a
    float32 VMEM accumulator; `kernel_body(x_ref, values_ref, scales_ref, out_ref,
    accumulator_ref)` multiplies one tile and scales the sum on the last I step.

    Args:
        kernel_body: The format's kernel.
        weight_format: Its name (block-size tuning and error messages).
        x: `[T, I]` activations, checked by the caller.
        values: `[I, O]` stored weights.
        scales: `[O]` float32 per-output-channel scales.
        blocks: `(block_m, block_n, block_k)`; None ones come from `tuning.py`.
        out_dtype: Result dtype.
        interpret: `pallas_call`'s interpret argument.

    Returns:
        `[T, O]`.
    """
    k, n = values.shape
    m = x.shape[0]
    block_m, block_n, block_k = _resolve_blocks(weight_format, m, k, n, blocks)
    x_padded = _pad_rows(x, block_m)  # [T', I]
    m_padded = x_padded.shape[0]
    out = pl.pallas_call(
        kernel_body,
        out_shape=jax.ShapeDtypeStruct((m_padded, n), out_dtype),
        grid=_grid(m_padded, n, k, block_m, block_n, block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((block_k, block_n), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((1, block_n), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
        name=f"{weight_format}_matmul",
    )(x_padded, values, scales.astype(jnp.float32).reshape(1, n))  # [T', O]
    return out[:m]  # [T, O]


# --- group-wise scales: packed int4 and grouped int8 weights --------------------------------


def _sign_extend_nibble(nibble: jax.Array) -> jax.Array:
    """4-bit two's complement in an int32 (values 0..15) to its signed value (-8..7)."""
    return (nibble ^ 8) - 8


def _grouped_kernel(x_ref, values_ref, scales_ref, *rest, group_size: int, has_zeros: bool,
                    packed: bool):
    if has_zeros:
        zeros_ref, out_ref, accumulator_ref = rest
    else:
        (out_ref, accumulator_ref), zeros_ref = rest, None
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _zero():
        accumulator_ref[...] = jnp.zeros_like(accumulator_ref)

    stored_k, block_n = values_ref.shape  # block_k // 2 (packed) or block_k, block_n
    groups = scales_ref.shape[0]  # block_k // group_size (group_size <= block_k here)
    scales = scales_ref[...]  # [groups, block_n]
    # int8 or float32 zero points alike become float32 here.
    zeros = zeros_ref[...].astype(jnp.float32) if has_zeros else None  # [groups, block_n]

    def dequantize(values: jax.Array) -> jax.Array:
        # `values` holds whole groups of consecutive rows: `rows` of them per group.
        rows = values.shape[0] // groups
        values = values.astype(jnp.float32).reshape(groups, rows, block_n)  # [C', rows, block_n]
        if has_zeros:
            values = values - zeros[:, None, :]
        return (values * scales[:, None, :]).reshape(groups * rows, block_n)

    x = x_ref[...].astype(jnp.float32)  # [block_m, block_k]
    if packed:
        # Bit operations on int32: narrow integer vector ops lower poorly (or not at all) on
        # older TPU generations. Row r of one nibble half is original row 2r (or 2r + 1) of
        # the block, so each group of `group_size` original rows is `group_size / 2`
        # consecutive rows of a half.
        nibbles = values_ref[...].astype(jnp.int32)  # [block_k / 2, block_n]
        low = dequantize(_sign_extend_nibble(nibbles & 0xF))  # [block_k / 2, block_n] even rows
        high = dequantize(_sign_extend_nibble(nibbles >> 4))  # [block_k / 2, block_n] odd rows
        # The wrapper reordered each block_k block of x to [even columns, odd columns], so the
        # two halves of the x tile line up with the two nibbles and no interleave is needed.
        partial = jnp.dot(x[:, :stored_k], low, precision=_HIGHEST,
                          preferred_element_type=jnp.float32)  # [block_m, block_n]
        partial += jnp.dot(x[:, stored_k:], high, precision=_HIGHEST,
                           preferred_element_type=jnp.float32)
    else:
        weight = dequantize(values_ref[...])  # [block_k, block_n]
        partial = jnp.dot(x, weight, precision=_HIGHEST,
                          preferred_element_type=jnp.float32)  # [block_m, block_n]
    accumulator_ref[...] += partial

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _write():
        out_ref[...] = accumulator_ref[...].astype(out_ref.dtype)


# The most rows of I a grouped block may hold when the kernel picks block_k. A block must hold
# whole groups in whole 128-lane tiles (or lie inside one group, for groups that are multiples
# of 128), so a group such as 200 forces block_k = lcm(128, 200) = 3200. Compiled for TPU v4
# at M = 256, a group of 136 (block_k 2176) took 8.8 MiB of VMEM, about half the 16 MiB a
# Mosaic kernel gets by default on v4, v5e and v5p; a group of 200 took 12.7 MiB and one of
# 1000 (block_k 8000) failed to compile on v4, v5e and v5p.
MAX_INT4_BLOCK_K = 2048


def _split_even_odd_columns(x: jax.Array, block_k: int) -> jax.Array:
    """Within each block_k block of `[T, I]` x, puts the even columns first, then the odd ones.

    This costs one pass over the activations (small next to the weights in decode) and
    saves the kernel an interleave of the unpacked nibbles along sublanes.
    """
    m, k = x.shape
    blocks = x.reshape(m, k // block_k, block_k // 2, 2)  # [T, I / block_k, block_k / 2, 2]
    return blocks.swapaxes(2, 3).reshape(m, k)  # [T, I]


@functools.partial(jax.jit, static_argnames=(*_STATIC, "group_size"))
def int4_matmul(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    zeros: jax.Array | None,
    *,
    group_size: int,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    out_dtype: jnp.dtype | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`x @ dequantize(packed, scales, zeros)` with packed int4 weights.

    Args:
        x: `[T, I]` float32 or bfloat16 activations.
        packed: `[I // 2, O]` uint8, two int4 values per byte, low nibble = even row.
        scales: `[C, O]` float32.
        zeros: `[C, O]` zero points, int8 or float32 (a float zero point holds an offset
            that is not a whole number of steps, as GGUF's Q4_1 needs), or None for
            symmetric weights.
        group_size: Rows of I per scale group; block_k must be a multiple or a divisor
            of it.
        block_m, block_n, block_k: Block sizes; unset ones come from `tuning.py`.
        out_dtype: Result dtype; defaults to the dtype of `x`.
        interpret: `pallas_call`'s interpret argument.

    Returns:
        `[T, O]`.

    Raises:
        ValueError: Mismatched shapes; I not a multiple of group_size; I / O not multiples
            of block_k / block_n; block_k neither a multiple nor a divisor of group_size; a
            group size that forces blocks over `MAX_INT4_BLOCK_K` rows (block_k unset).
    """
    return _grouped_matmul(x, packed, scales, zeros, "int4", group_size=group_size,
                           blocks=(block_m, block_n, block_k), out_dtype=out_dtype,
                           interpret=interpret)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "group_size"))
def int8_grouped_matmul(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array,
    *,
    group_size: int,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    out_dtype: jnp.dtype | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`x @ (values * scales)` with int8 weights and group-wise scales (GGUF's Q8_0).

    The int4 kernel without the unpacking: each int8 tile is scaled group by group in
    VMEM, then multiplied.

    Args:
        x: `[T, I]` float32 or bfloat16 activations.
        values: `[I, O]` int8.
        scales: `[C, O]` float32, one per `group_size` rows and column.
        group_size: Rows of I per scale group, as for `int4_matmul`.
        block_m, block_n, block_k: Block sizes; unset ones come from `tuning.py`.
        out_dtype: Result dtype; defaults to the dtype of `x`.
        interpret: `pallas_call`'s interpret argument.

    Returns:
        `[T, O]`.

    Raises:
        ValueError: As `int4_matmul`.
    """
    return _grouped_matmul(x, values, scales, None, "int8_grouped", group_size=group_size,
                           blocks=(block_m, block_n, block_k), out_dtype=out_dtype,
                           interpret=interpret)


def _grouped_matmul(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array,
    zeros: jax.Array | None,
    weight_format: str,
    *,
    group_size: int,
    blocks: tuple[int | None, int | None, int | None],
    out_dtype: jnp.dtype | None,
    interpret: bool | pltpu.InterpretParams,
) -> jax.Array:
    """The shared wrapper of `int4_matmul` (packed nibbles) and `int8_grouped_matmul`."""
    packed = weight_format == "int4"
    stored_k, n = values.shape
    k = 2 * stored_k if packed else stored_k
    _check_inner_dimension(weight_format, x, k, n)
    if group_size <= 0 or (packed and group_size % 2) or k % group_size:
        raise ValueError(f"{weight_format} matmul: K={k} (stored weight shape {values.shape}) "
                         f"is not a multiple of group_size={group_size}, or group_size is "
                         f"{'odd' if packed else 'not positive'}")
    expected = (k // group_size, n)
    if scales.shape != expected or (zeros is not None and zeros.shape != expected):
        raise ValueError(f"{weight_format} matmul: scales {scales.shape} and zeros "
                         f"{None if zeros is None else zeros.shape} must be {expected} for "
                         f"K={k}, N={n}, group_size={group_size}")
    m = x.shape[0]
    chosen = blocks[2] is None
    block_m, block_n, block_k = _resolve_blocks(weight_format, m, k, n, blocks, group_size)
    if chosen and block_k > MAX_INT4_BLOCK_K:
        raise ValueError(
            f"{weight_format} matmul: group_size={group_size} with K={k} takes blocks of "
            f"block_k={block_k} rows of I (whole groups in whole 128-lane tiles), over the "
            f"{MAX_INT4_BLOCK_K} whose dequantized tiles fit TPU VMEM; use a group size that "
            f"is a multiple of 128 or whose least common multiple with 128 is at most "
            f"{MAX_INT4_BLOCK_K} (such as 32, 64, 96, 128, 256)")
    if block_k % group_size and group_size % block_k:
        raise ValueError(f"{weight_format} matmul: block_k={block_k} is neither a multiple nor "
                         f"a divisor of group_size={group_size}")
    # A block holds `groups` whole groups, or lies inside one group (blocks_per_group of them
    # share its scales): to the kernel, a group is then the block's rows.
    block_group = min(group_size, block_k)
    groups = block_k // block_group
    blocks_per_group = group_size // block_group
    x_padded = _pad_rows(x, block_m)  # [T', I]
    if packed:
        x_padded = _split_even_odd_columns(x_padded, block_k)  # [T', I]
    m_padded = x_padded.shape[0]
    # [C / groups, groups, O]: a block's groups become a whole (full-size) second-minor
    # dimension, a legal block shape even when `groups` is 1 or 2, below the sublane tile.
    group_spec = pl.BlockSpec((pl.Squeezed(), groups, block_n),
                              lambda i, j, kk: (kk // blocks_per_group, 0, j))
    operands = [x_padded, values,
                scales.astype(jnp.float32).reshape(k // group_size // groups, groups, n)]
    stored_block_k = block_k // 2 if packed else block_k
    in_specs = [
        pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((stored_block_k, block_n), lambda i, j, kk: (kk, j)),
        group_spec,
    ]
    if zeros is not None:
        zeros_dtype = jnp.float32 if jnp.issubdtype(zeros.dtype, jnp.floating) else jnp.int8
        operands.append(zeros.astype(zeros_dtype).reshape(k // group_size // groups, groups, n))
        in_specs.append(group_spec)
    kernel = functools.partial(_grouped_kernel, group_size=block_group,
                               has_zeros=zeros is not None, packed=packed)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_padded, n), out_dtype or x.dtype),
        grid=_grid(m_padded, n, k, block_m, block_n, block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
        name=f"{weight_format}_matmul",
    )(*operands)  # [T', O]
    return out[:m]  # [T, O]


# --- W8A8: int8 activations (quantized per token) times int8 weights -------------------------


# Rows of I whose int8 products a float32 sum holds exactly: every |product| is at most
# 128 * 128 = 2**14, so 1024 of them sum to at most 2**24, below which float32 holds every
# integer.
_EXACT_F32_ROWS = 1024


def int8_matmul_units() -> bool:
    """Whether the TPU being compiled for multiplies int8 by int8 on its MXU (v5e and later;
    not v4). Read when tracing: the TPU is the one of the mesh set by `jax.set_mesh` (how an
    ahead-of-time compile names it), else the default device's."""
    try:
        info = pltpu.get_tpu_info()
    except ValueError:  # not a TPU: the kernel cannot compile here anyway, nothing to adapt
        return True
    return info.is_matmul_supported(jnp.int8, jnp.int8)


def _w8a8_kernel(x_ref, x_scales_ref, weight_ref, weight_scales_ref, out_ref, accumulator_ref,
                 *, rescale: bool, int8_matmul: bool):
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _zero():
        accumulator_ref[...] = jnp.zeros_like(accumulator_ref)

    if int8_matmul:
        accumulator_ref[...] += jax.lax.dot(x_ref[...], weight_ref[...],
                                            preferred_element_type=jnp.int32)  # [block_m, block_n]
    else:
        # No int8 x int8 MXU mode (TPU v4): int8 values are exact in bf16 (8 significant bits),
        # their products exact in the f32 sum, and the sum of up to `_EXACT_F32_ROWS` of them
        # too, so each chunk of that many rows of I is summed in f32 and added as an integer.
        block_k = x_ref.shape[1]
        for start in range(0, block_k, _EXACT_F32_ROWS):
            stop = min(start + _EXACT_F32_ROWS, block_k)
            partial = jax.lax.dot(x_ref[:, start:stop].astype(jnp.bfloat16),
                                  weight_ref[start:stop, :].astype(jnp.bfloat16),
                                  preferred_element_type=jnp.float32)  # [block_m, block_n]
            accumulator_ref[...] += partial.astype(jnp.int32)

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _write():
        accumulator = accumulator_ref[...]  # [block_m, block_n] int32
        if rescale:
            # Same operations, same order as `reference.w8a8_rescale`.
            result = (accumulator.astype(jnp.float32) * x_scales_ref[...]) * weight_scales_ref[...]
            out_ref[...] = result.astype(out_ref.dtype)
        else:
            out_ref[...] = accumulator


def _w8a8_call(
    x_values: jax.Array,
    x_scales: jax.Array,
    weight_values: jax.Array,
    weight_scales: jax.Array,
    *,
    blocks: tuple[int | None, int | None, int | None],
    out_dtype: jnp.dtype,
    rescale: bool,
    interpret: bool | pltpu.InterpretParams,
    int8_matmul: bool | None,
) -> jax.Array:
    k, n = weight_values.shape
    _check_inner_dimension("w8a8", x_values, k, n)
    if int8_matmul is None:
        int8_matmul = bool(interpret) or int8_matmul_units()
    m = x_values.shape[0]
    block_m, block_n, block_k = _resolve_blocks("w8a8", m, k, n, blocks)
    x_padded = _pad_rows(x_values, block_m)  # [T', I] int8
    x_scales_padded = _pad_rows(x_scales.astype(jnp.float32).reshape(m, 1), block_m,
                                1.0)  # [T', 1]
    m_padded = x_padded.shape[0]
    out = pl.pallas_call(
        functools.partial(_w8a8_kernel, rescale=rescale, int8_matmul=int8_matmul),
        out_shape=jax.ShapeDtypeStruct((m_padded, n), out_dtype if rescale else jnp.int32),
        grid=_grid(m_padded, n, k, block_m, block_n, block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((block_m, 1), lambda i, j, kk: (i, 0)),
            pl.BlockSpec((block_k, block_n), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((1, block_n), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.int32)],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
        name="w8a8_matmul" if rescale else "w8a8_int32_product",
    )(x_padded, x_scales_padded, weight_values,
      weight_scales.astype(jnp.float32).reshape(1, n))  # [T', O]
    return out[:m]  # [T, O]


@functools.partial(jax.jit, static_argnames=(*_STATIC, "int8_matmul"))
def w8a8_matmul(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    out_dtype: jnp.dtype | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    int8_matmul: bool | None = None,
) -> jax.Array:
    """Quantizes `x` per token to int8, multiplies in int32 in the kernel, then rescales.

    Args:
        x: `[T, I]` float32 or bfloat16 activations.
        values: `[I, O]` int8 weights.
        scales: `[O]` float32 per-output-channel weight scales.
        block_m, block_n, block_k: Block sizes; unset ones come from `tuning.py`.
        out_dtype: Result dtype; defaults to the dtype of `x`.
        interpret: `pallas_call`'s interpret argument.
        int8_matmul: Multiply int8 by int8 on the MXU (True) or as bf16 with exact f32 chunk
            sums (False); None: the former where the target TPU can (`int8_matmul_units`)
            and in interpret mode.

    Returns:
        `[T, O]`.

    Raises:
        ValueError: Mismatched shapes, or I / O not multiples of block_k / block_n.
    """
    x_values, x_scales = reference.quantize_per_token_int8(x)  # [T, I] int8, [T]
    return _w8a8_call(x_values, x_scales, values, scales,
                      blocks=(block_m, block_n, block_k), out_dtype=out_dtype or x.dtype,
                      rescale=True, interpret=interpret, int8_matmul=int8_matmul)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret",
                                             "int8_matmul"))
def w8a8_int32_product(
    x_values: jax.Array,
    weight_values: jax.Array,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    int8_matmul: bool | None = None,
) -> jax.Array:
    """The W8A8 kernel's int32 accumulator, before rescaling (for exact tests).

    Args:
        x_values: `[T, I]` int8 activations.
        weight_values: `[I, O]` int8 weights.
        block_m, block_n, block_k: Block sizes; unset ones come from `tuning.py`.
        interpret: `pallas_call`'s interpret argument.
        int8_matmul: As for `w8a8_matmul`.

    Returns:
        `[T, O]` int32.
    """
    m, n = x_values.shape[0], weight_values.shape[1]
    ones_m = jnp.ones((m,), jnp.float32)  # [T] unused: the kernel skips the rescale
    ones_n = jnp.ones((n,), jnp.float32)  # [O]
    return _w8a8_call(x_values, ones_m, weight_values, ones_n,
                      blocks=(block_m, block_n, block_k), out_dtype=jnp.int32,
                      rescale=False, interpret=interpret, int8_matmul=int8_matmul)
