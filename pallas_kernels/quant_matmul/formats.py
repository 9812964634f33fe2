"""The weight-format registry: every quantized weight format is one `WeightFormat` entry.

An entry says everything the rest of the stack needs to know about a format: its name,
which bit widths and options it holds, how a float `[I, O]` weight is quantized into it
(round to nearest) and dequantized back, its readable reference matmul and its kernel
matmul, and (for formats on an integer grid) the pieces GPTQ needs to round one group at a
time. `quantize_weight`, `dequantize_weight` and `quantized_matmul` (the package's public
ops), `jaxinfer.quant` (schemes, quantized layers, RTN, GPTQ, checkpoints) and the model
look formats up here and never compare format names, so a new format is one
`register_format(WeightFormat(...))` call plus its kernel.

Built in:

    "int8"  int8 weights, per-output-channel scales, float activations
    "int4"  packed int4 weights, group-wise scales, optional zero points; also holds 3- and
            2-bit grids in the same nibble storage. Zero points are int8 when quantized
            here; float32 zero points (offsets that are not whole steps, e.g. GGUF's Q4_1
            `d * q + m`, where z = -8 - m / d) run through the same reference and kernel
    "int8_grouped"  int8 weights, one scale per group of rows (GGUF's Q8_0: 32 rows),
            symmetric; the int4 kernel's grouped path without the unpacking
    "w8a8"  int8 weights and per-token int8 activations, int32 accumulation
    "sparse24", "sparse24_int8", "sparse24_int4"  2:4 semi-structured sparse weights stored
            compressed (kept values plus 2-bit positions, `sparse24.py`): float values
            (bf16, or f32 at bits=32), int8 values with per-output-channel scales, or int4
            values with group-wise symmetric scales. Their quantizers take weights that are
            already 2:4 sparse and refuse others (`sparse24.prune_2_4` prunes one)
    "fp8"   float8_e4m3fn weights, per-output-channel float32 scales (max |w| / 448), float
            activations (`fp8.py`, kernel `fp8_kernel.py`)

Unquantized weights are not an entry: they stay float parameters of the model
(`jaxinfer.models.layers.LinearParam`), multiplied by XLA.

Every format stores a `QuantizedWeight`: `values` (integers, possibly packed), `scales`
(None for the float sparse format), optional `zeros` and `positions` (sparse formats), and
the static `group_size` and `bits`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quant_matmul import (
    fp8,
    fp8_kernel,
    kernel,
    reference,
    sparse24,
    sparse24_kernel,
)

__all__ = ["QuantizedWeight", "WeightFormat", "get_format", "register_format",
           "registered_formats"]

Interpret = bool | pltpu.InterpretParams


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized `[I, O]` weight. A pytree: arrays are leaves, format and group are static.

    Attributes:
        format: The name of a registered `WeightFormat` ("int8", "int4", "w8a8", ...).
        values: The stored values: int8 `[I, O]` for "int8" and "w8a8", uint8
            `[I // 2, O]` for "int4" (two values per byte), float8_e4m3fn `[I, O]` for
            "fp8"; in general
            `[I // format.rows_per_stored_row, O]`.
        scales: float32 `[O]` for per-channel formats, `[C, O]` for grouped; None for
            formats without scales (float "sparse24").
        zeros: `[C, O]` zero points of an asymmetric grouped weight (int8, or float32 for
            "int4" offsets that are not whole steps), else None.
        group_size: Rows per scale group for grouped formats, else None.
        bits: Bit width of the values: the format's default when not given (8 for "int8"
            and "w8a8"; 4, 3 or 2 for "int4", whose narrower grids use fewer of the nibble's
            levels, see `reference.int4_levels`; storage and kernel are the same; 16 or 32
            for "sparse24", bf16 or f32 values).
        positions: `[I // 8, O]` uint8 positions of the kept values of a 2:4 sparse weight
            (`sparse24.py`), else None.
    """

    format: str
    values: jax.Array
    scales: jax.Array | None
    zeros: jax.Array | None = None
    group_size: int | None = None
    bits: int | None = None
    positions: jax.Array | None = None

    def __post_init__(self):
        weight_format = get_format(self.format, "quantized weight format")
        if weight_format.grouped and not self.group_size:
            raise ValueError(f"an {self.format} QuantizedWeight needs group_size")
        if self.bits is None:  # frozen dataclass: the default depends on the format
            object.__setattr__(self, "bits", weight_format.bits[0])
        if self.bits not in weight_format.bits:
            raise ValueError(f"a {self.format} QuantizedWeight holds {weight_format.bits} "
                             f"bits, got bits={self.bits}")

    @property
    def shape(self) -> tuple[int, int]:
        """The `(I, O)` shape of the weight this stands for."""
        rows, columns = self.values.shape
        return rows * get_format(self.format).rows_per_stored_row, columns


jax.tree_util.register_dataclass(QuantizedWeight,
                                 data_fields=["values", "scales", "zeros", "positions"],
                                 meta_fields=["format", "group_size", "bits"])

# (x [T, I], weight, out_dtype or None for x's dtype) -> [T, O]
ReferenceMatmul = Callable[[jax.Array, QuantizedWeight, jnp.dtype | None], jax.Array]
# (x [T, I], weight, out_dtype or None, pallas_call's interpret argument) -> [T, O]
KernelMatmul = Callable[[jax.Array, QuantizedWeight, jnp.dtype | None, Interpret], jax.Array]
# (w [I, O] float, bits, group_size or None, symmetric) -> QuantizedWeight
Quantize = Callable[[jax.Array, int, int | None, bool], QuantizedWeight]
# (bits, symmetric) -> (lowest, highest) integer level a value may take
Levels = Callable[[int, bool], tuple[int, int]]
# (groups [C, group_size, O] float, bits, symmetric)
#     -> (scales [C, O] float32, zeros [C, O] int8 | None)
GridParameters = Callable[[jax.Array, int, bool], tuple[jax.Array, jax.Array | None]]
# (levels [I, O] int8, scales [C, O] float32, zeros [C, O] int8 | None, group_size or None,
#  bits) -> QuantizedWeight
FromLevels = Callable[[jax.Array, jax.Array, jax.Array | None, int | None, int],
                      QuantizedWeight]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightFormat:
    """One weight format: what it holds, how to make it, and how to multiply by it.

    Attributes:
        name: The registry key, stored in `QuantizedWeight.format`, `WeightScheme.format`
            and quantized checkpoints' configs.
        bits: The bit widths it holds; the first is the default.
        grouped: True: one scale (and zero point) per `group_size` input rows and output
            column; False: one scale per output column, and no group_size.
        zero_points: Whether it can store zero points (asymmetric weights); else symmetric
            only.
        group_multiple: group_size must be a positive multiple of this (grouped formats).
        rows_per_stored_row: Input rows per row of `values` (2 when two values share a
            byte along I, or when half the values of a 2:4 weight are kept).
        sparse_2_4: The format holds 2:4 sparse weights only: `quantize` refuses a weight
            with more than 2 non-zeros in any 4 consecutive input rows of a column.
        quantize: Round-to-nearest quantization of a float `[I, O]` weight.
        dequantize: The float32 `[I, O]` matrix a `QuantizedWeight` stands for.
        reference_matmul: `x @ weight`, the readable jnp reference (the XLA path).
        kernel_matmul: `x @ weight` through the Pallas kernel.
        levels: For integer-grid formats, the integer levels a value may take; with
            `grid_parameters` and `from_levels` this lets GPTQ round one group at a time.
            None: GPTQ cannot target the format.
        grid_parameters: Scales (and zero points) of `[C, group_size, O]` weight groups, by the
            same rule as `quantize` (for per-channel formats C = 1 and group_size = I).
        from_levels: The `QuantizedWeight` of `[I, O]` integer levels and their
            `[C, O]` scales (and zeros).
    """

    name: str
    bits: tuple[int, ...]
    grouped: bool
    zero_points: bool
    group_multiple: int = 1
    rows_per_stored_row: int = 1
    sparse_2_4: bool = False
    quantize: Quantize
    dequantize: Callable[[QuantizedWeight], jax.Array]
    reference_matmul: ReferenceMatmul
    kernel_matmul: KernelMatmul
    levels: Levels | None = None
    grid_parameters: GridParameters | None = None
    from_levels: FromLevels | None = None

    def check_options(self, bits: int, group_size: int | None, symmetric: bool) -> None:
        """Raises ValueError unless the format holds `bits`, `group_size` and `symmetric`."""
        if bits not in self.bits:
            held = (f"weights are {self.bits[0]}-bit" if len(self.bits) == 1 else
                    f"storage holds {min(self.bits)} to {max(self.bits)} bits")
            raise ValueError(f"{self.name} {held}, got bits={bits}")
        if not symmetric and not self.zero_points:
            raise ValueError(f"{self.name} weights are symmetric only")
        if self.grouped:
            if not group_size or group_size % self.group_multiple:
                wanted = ("an even group_size" if self.group_multiple == 2 else
                          f"a group_size that is a multiple of {self.group_multiple}")
                raise ValueError(f"{self.name} needs {wanted}, got {group_size}")
        elif group_size is not None:
            raise ValueError(f"{self.name} has one scale per output channel; "
                             f"group_size must be None, got {group_size}")

    def group_rows(self, k: int, group_size: int | None) -> int:
        """Input rows sharing one scale: `group_size` for grouped formats, else all I."""
        return group_size if self.grouped else k


_REGISTRY: dict[str, WeightFormat] = {}


def register_format(weight_format: WeightFormat, *, replace: bool = False) -> WeightFormat:
    """Adds a format to the registry (under its name) and returns it.

    Raises:
        ValueError: The name is taken and `replace` is False.
    """
    if weight_format.name in _REGISTRY and not replace:
        raise ValueError(f"weight format {weight_format.name!r} is already registered")
    _REGISTRY[weight_format.name] = weight_format
    return weight_format


def unregister_format(name: str) -> None:
    """Removes a format (for tests that register a temporary one)."""
    _REGISTRY.pop(name, None)


def registered_formats() -> tuple[str, ...]:
    """The names of every registered format, in registration order."""
    return tuple(_REGISTRY)


def get_format(name: str, what: str = "weight format") -> WeightFormat:
    """The registered format called `name`.

    Raises:
        ValueError: No such format (the message lists the known ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


# --- int8 per output channel (weight-only) and W8A8 -----------------------------------------


def _quantize_per_channel(name: str) -> Quantize:
    def quantize(w: jax.Array, bits: int, group_size: int | None,
                 symmetric: bool) -> QuantizedWeight:
        del bits, group_size, symmetric  # 8-bit, per channel, symmetric: checked before
        values, scales = reference.quantize_int8_per_channel(w)  # [I, O], [O]
        return QuantizedWeight(name, values, scales)
    return quantize


def _dequantize_per_channel(weight: QuantizedWeight) -> jax.Array:
    return reference.dequantize_int8_per_channel(weight.values, weight.scales)  # [I, O]


def _int8_levels(bits: int, symmetric: bool) -> tuple[int, int]:
    del bits, symmetric
    return -reference.INT8_MAX, reference.INT8_MAX


def _int8_grid_parameters(groups: jax.Array, bits: int, symmetric: bool
                          ) -> tuple[jax.Array, None]:
    del bits, symmetric
    groups = groups.astype(jnp.float32)  # [C, group_size, O]
    # The rule of `reference.quantize_int8_per_channel`, per group.
    maximum = jnp.max(jnp.abs(groups), axis=1) / reference.INT8_MAX  # [C, O]
    return jnp.where(maximum > 0, maximum, 1.0), None


def _per_channel_from_levels(name: str) -> FromLevels:
    def from_levels(levels: jax.Array, scales: jax.Array, zeros: jax.Array | None,
                    group_size: int | None, bits: int) -> QuantizedWeight:
        del zeros, group_size, bits
        return QuantizedWeight(name, levels.astype(jnp.int8), scales[0])  # [I, O], [O]
    return from_levels


def _int8_reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    return reference.int8_matmul_reference(x, weight.values, weight.scales,
                                           out_dtype=out_dtype)


def _int8_kernel(x: jax.Array, weight: QuantizedWeight, out_dtype, interpret) -> jax.Array:
    return kernel.int8_matmul(x, weight.values, weight.scales, out_dtype=out_dtype,
                              interpret=interpret)


def _w8a8_reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    return reference.w8a8_matmul_reference(x, weight.values, weight.scales,
                                           out_dtype=out_dtype)


def _w8a8_kernel(x: jax.Array, weight: QuantizedWeight, out_dtype, interpret) -> jax.Array:
    return kernel.w8a8_matmul(x, weight.values, weight.scales, out_dtype=out_dtype,
                              interpret=interpret)


# --- int4 (and 3-, 2-bit) group-wise, two values per byte ------------------------------------


def _int4_quantize(w: jax.Array, bits: int, group_size: int | None,
                   symmetric: bool) -> QuantizedWeight:
    packed, scales, zeros = reference.quantize_int4_grouped(
        w, group_size, symmetric=symmetric, bits=bits)  # [I // 2, O], [C, O], [C, O] or None
    return QuantizedWeight("int4", packed, scales, zeros, group_size, bits)


def _int4_dequantize(weight: QuantizedWeight) -> jax.Array:
    return reference.dequantize_int4_grouped(weight.values, weight.scales, weight.zeros,
                                             weight.group_size)  # [I, O]


def _int4_grid_parameters(groups: jax.Array, bits: int, symmetric: bool
                          ) -> tuple[jax.Array, jax.Array | None]:
    return reference.grouped_quantization_parameters(groups, bits, symmetric=symmetric)


def _int4_from_levels(levels: jax.Array, scales: jax.Array, zeros: jax.Array | None,
                      group_size: int | None, bits: int) -> QuantizedWeight:
    packed = reference.pack_int4(levels)  # [I // 2, O]
    return QuantizedWeight("int4", packed, scales, zeros, group_size, bits)


def _int4_reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    return reference.int4_matmul_reference(x, weight.values, weight.scales, weight.zeros,
                                           weight.group_size, out_dtype=out_dtype)


def _int4_kernel(x: jax.Array, weight: QuantizedWeight, out_dtype, interpret) -> jax.Array:
    return kernel.int4_matmul(x, weight.values, weight.scales, weight.zeros,
                              group_size=weight.group_size, out_dtype=out_dtype,
                              interpret=interpret)


# --- int8 group-wise (GGUF's Q8_0) -----------------------------------------------------------


def _int8_grouped_quantize(w: jax.Array, bits: int, group_size: int | None,
                           symmetric: bool) -> QuantizedWeight:
    del bits, symmetric  # 8-bit, symmetric: checked before
    values, scales = reference.quantize_int8_grouped(w, group_size)  # [I, O], [C, O]
    return QuantizedWeight("int8_grouped", values, scales, None, group_size)


def _int8_grouped_dequantize(weight: QuantizedWeight) -> jax.Array:
    return reference.dequantize_grouped(weight.values, weight.scales, None,
                                        weight.group_size)  # [I, O]


def _int8_grouped_from_levels(levels: jax.Array, scales: jax.Array, zeros: jax.Array | None,
                              group_size: int | None, bits: int) -> QuantizedWeight:
    del zeros, bits
    return QuantizedWeight("int8_grouped", levels.astype(jnp.int8), scales, None, group_size)


def _int8_grouped_reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    return reference.int8_grouped_matmul_reference(x, weight.values, weight.scales,
                                                   weight.group_size, out_dtype=out_dtype)


def _int8_grouped_kernel(x: jax.Array, weight: QuantizedWeight, out_dtype,
                         interpret) -> jax.Array:
    return kernel.int8_grouped_matmul(x, weight.values, weight.scales,
                                      group_size=weight.group_size, out_dtype=out_dtype,
                                      interpret=interpret)


register_format(WeightFormat(
    name="int8", bits=(8,), grouped=False, zero_points=False,
    quantize=_quantize_per_channel("int8"), dequantize=_dequantize_per_channel,
    reference_matmul=_int8_reference, kernel_matmul=_int8_kernel,
    levels=_int8_levels, grid_parameters=_int8_grid_parameters,
    from_levels=_per_channel_from_levels("int8")))

register_format(WeightFormat(
    name="int4", bits=(4, 3, 2), grouped=True, zero_points=True, group_multiple=2,
    rows_per_stored_row=2,
    quantize=_int4_quantize, dequantize=_int4_dequantize,
    reference_matmul=_int4_reference, kernel_matmul=_int4_kernel,
    levels=reference.int4_levels, grid_parameters=_int4_grid_parameters,
    from_levels=_int4_from_levels))

register_format(WeightFormat(
    name="w8a8", bits=(8,), grouped=False, zero_points=False,
    quantize=_quantize_per_channel("w8a8"), dequantize=_dequantize_per_channel,
    reference_matmul=_w8a8_reference, kernel_matmul=_w8a8_kernel,
    levels=_int8_levels, grid_parameters=_int8_grid_parameters,
    from_levels=_per_channel_from_levels("w8a8")))

register_format(WeightFormat(
    name="int8_grouped", bits=(8,), grouped=True, zero_points=False,
    quantize=_int8_grouped_quantize, dequantize=_int8_grouped_dequantize,
    reference_matmul=_int8_grouped_reference, kernel_matmul=_int8_grouped_kernel,
    levels=_int8_levels, grid_parameters=_int8_grid_parameters,
    from_levels=_int8_grouped_from_levels))


# --- 2:4 sparse, compressed: float, int8 per channel and int4 group-wise values --------------


def _sparse24_quantize(w: jax.Array, bits: int, group_size: int | None,
                       symmetric: bool) -> QuantizedWeight:
    del group_size, symmetric  # per channel (no scales), symmetric: checked before
    sparse24.check_2_4(w)
    values, positions = sparse24.compress_float(
        w, jnp.bfloat16 if bits == 16 else jnp.float32)  # [I // 2, O], [I // 8, O]
    return QuantizedWeight("sparse24", values, None, bits=bits, positions=positions)


def _sparse24_dequantize(weight: QuantizedWeight) -> jax.Array:
    return sparse24.expand_float(weight.values, weight.positions)  # [I, O]


def _sparse24_reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    return sparse24.dense_matmul_reference(x, _sparse24_dequantize(weight), out_dtype)


def _sparse24_kernel(x: jax.Array, weight: QuantizedWeight, out_dtype, interpret) -> jax.Array:
    return sparse24_kernel.sparse24_matmul(x, weight.values, weight.positions, kind="float",
                                           out_dtype=out_dtype, interpret=interpret)


def _sparse24_int8_quantize(w: jax.Array, bits: int, group_size: int | None,
                            symmetric: bool) -> QuantizedWeight:
    del bits, group_size, symmetric  # 8-bit, per channel, symmetric: checked before
    sparse24.check_2_4(w)
    values, scales, positions = sparse24.compress_int8(w)  # [I // 2, O], [O], [I // 8, O]
    return QuantizedWeight("sparse24_int8", values, scales, positions=positions)


def _sparse24_int8_dequantize(weight: QuantizedWeight) -> jax.Array:
    return sparse24.expand_int8(weight.values, weight.scales, weight.positions)  # [I, O]


def _sparse24_int8_reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    return sparse24.dense_matmul_reference(x, _sparse24_int8_dequantize(weight), out_dtype)


def _sparse24_int8_kernel(x: jax.Array, weight: QuantizedWeight, out_dtype,
                          interpret) -> jax.Array:
    return sparse24_kernel.sparse24_matmul(x, weight.values, weight.positions, weight.scales,
                                           kind="int8", out_dtype=out_dtype,
                                           interpret=interpret)


def _sparse24_int4_quantize(w: jax.Array, bits: int, group_size: int | None,
                            symmetric: bool) -> QuantizedWeight:
    del symmetric  # symmetric only: checked before
    sparse24.check_2_4(w)
    values, scales, positions = sparse24.compress_int4(
        w, group_size, bits)  # [I // 4, O], [C, O], [I // 8, O]
    return QuantizedWeight("sparse24_int4", values, scales, None, group_size, bits,
                           positions=positions)


def _sparse24_int4_dequantize(weight: QuantizedWeight) -> jax.Array:
    return sparse24.expand_int4(weight.values, weight.scales, weight.positions,
                                weight.group_size)  # [I, O]


def _sparse24_int4_reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    return sparse24.dense_matmul_reference(x, _sparse24_int4_dequantize(weight), out_dtype)


def _sparse24_int4_kernel(x: jax.Array, weight: QuantizedWeight, out_dtype,
                          interpret) -> jax.Array:
    return sparse24_kernel.sparse24_matmul(x, weight.values, weight.positions, weight.scales,
                                           kind="int4", group_size=weight.group_size,
                                           out_dtype=out_dtype, interpret=interpret)


# GPTQ cannot target these (no `levels`): its rounding would have to keep the 2:4 mask.
register_format(WeightFormat(
    name="sparse24", bits=(16, 32), grouped=False, zero_points=False, rows_per_stored_row=2,
    sparse_2_4=True, quantize=_sparse24_quantize, dequantize=_sparse24_dequantize,
    reference_matmul=_sparse24_reference, kernel_matmul=_sparse24_kernel))

register_format(WeightFormat(
    name="sparse24_int8", bits=(8,), grouped=False, zero_points=False, rows_per_stored_row=2,
    sparse_2_4=True, quantize=_sparse24_int8_quantize, dequantize=_sparse24_int8_dequantize,
    reference_matmul=_sparse24_int8_reference, kernel_matmul=_sparse24_int8_kernel))

register_format(WeightFormat(
    name="sparse24_int4", bits=(4, 3, 2), grouped=True, zero_points=False,
    group_multiple=sparse24.GROUP, rows_per_stored_row=4, sparse_2_4=True,
    quantize=_sparse24_int4_quantize, dequantize=_sparse24_int4_dequantize,
    reference_matmul=_sparse24_int4_reference, kernel_matmul=_sparse24_int4_kernel))


# --- fp8 (e4m3) per output channel -----------------------------------------------------------


def _fp8_quantize(w: jax.Array, bits: int, group_size: int | None,
                  symmetric: bool) -> QuantizedWeight:
    del bits, group_size, symmetric  # 8-bit, per channel, symmetric: checked before
    values, scales = fp8.quantize_fp8_per_channel(w)  # [I, O] float8_e4m3fn, [O]
    return QuantizedWeight("fp8", values, scales)


def _fp8_dequantize(weight: QuantizedWeight) -> jax.Array:
    return fp8.dequantize_fp8_per_channel(weight.values, weight.scales)  # [I, O]


def _fp8_reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    return fp8.fp8_matmul_reference(x, weight.values, weight.scales, out_dtype=out_dtype)


def _fp8_kernel(x: jax.Array, weight: QuantizedWeight, out_dtype, interpret) -> jax.Array:
    return fp8_kernel.fp8_matmul(x, weight.values, weight.scales, out_dtype=out_dtype,
                                 interpret=interpret)


# GPTQ cannot target it (no `levels`): e4m3 is a floating-point grid, not an integer one.
register_format(WeightFormat(
    name="fp8", bits=(8,), grouped=False, zero_points=False,
    quantize=_fp8_quantize, dequantize=_fp8_dequantize,
    reference_matmul=_fp8_reference, kernel_matmul=_fp8_kernel))
