"""Weight-quantized matmul: the public op and the weight pytree it takes.

`quantize_weight` turns a float `[K, N]` weight into a `QuantizedWeight` once, at load
time; `quantized_matmul(x, weight)` multiplies activations by it. Formats:

    "int8"  int8 weights, per-output-channel scales, float activations
    "int4"  packed int4 weights, group-wise scales, optional zero points
    "w8a8"  int8 weights and per-token int8 activations, int32 accumulation

`implementation=` follows `pallas_kernels.dispatch`: "xla" and "reference" run the jnp
reference, "pallas" the compiled TPU kernel, "interpret" the kernel in interpret mode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.quant_matmul import kernel, reference

__all__ = ["FORMATS", "QuantizedWeight", "dequantize_weight", "quantize_weight",
           "quantized_matmul"]

FORMATS = ("int8", "int4", "w8a8")


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized `[K, N]` weight. A pytree: arrays are leaves, format and group are static.

    Attributes:
        format: "int8", "int4" or "w8a8".
        values: int8 `[K, N]`, or for "int4" uint8 `[K // 2, N]` (two values per byte).
        scales: float32 `[N]`, or for "int4" `[K // group_size, N]`.
        zeros: int8 `[K // group_size, N]` zero points for asymmetric "int4", else None.
        group_size: Rows per scale group for "int4", else None.
        bits: Bit width of the values: 8 for "int8" and "w8a8"; 4, 3 or 2 for "int4"
            (narrower grids use fewer of the nibble's levels, see
            `reference.int4_levels`; storage and kernel are the same).
    """

    format: str
    values: jax.Array
    scales: jax.Array
    zeros: jax.Array | None = None
    group_size: int | None = None
    bits: int | None = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantized weight format {self.format!r}; "
                             f"known: {', '.join(FORMATS)}")
        if self.format == "int4" and not self.group_size:
            raise ValueError("an int4 QuantizedWeight needs group_size")
        if self.bits is None:  # frozen dataclass: the default depends on the format
            object.__setattr__(self, "bits", 4 if self.format == "int4" else 8)
        allowed = (2, 3, 4) if self.format == "int4" else (8,)
        if self.bits not in allowed:
            raise ValueError(f"a {self.format} QuantizedWeight holds {allowed} bits, "
                             f"got bits={self.bits}")

    @property
    def shape(self) -> tuple[int, int]:
        """The `(K, N)` shape of the weight this stands for."""
        rows, columns = self.values.shape
        return (2 * rows if self.format == "int4" else rows), columns


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["values", "scales", "zeros"],
                                 meta_fields=["format", "group_size", "bits"])


def quantize_weight(
    w: jax.Array, weight_format: str, *, group_size: int = 128, symmetric: bool = True,
    bits: int | None = None,
) -> QuantizedWeight:
    """Quantizes a float `[K, N]` weight.

    Args:
        w: `[K, N]` float weight (input features by output features).
        weight_format: "int8", "int4" or "w8a8".
        group_size: Rows per scale group (int4 only).
        symmetric: False gives int4 zero points (int4 only; int8 is always symmetric).
        bits: For "int4", 4 (default), 3 or 2; int8 formats take only 8 (or None).

    Returns:
        The `QuantizedWeight`.
    """
    if weight_format == "int4":
        bits = 4 if bits is None else bits
        packed, scales, zeros = reference.quantize_int4_grouped(w, group_size,
                                                                symmetric=symmetric, bits=bits)
        return QuantizedWeight("int4", packed, scales, zeros, group_size, bits)
    if bits not in (None, 8):
        raise ValueError(f"{weight_format} weights are 8-bit, got bits={bits}")
    if weight_format not in FORMATS:
        raise ValueError(f"unknown quantized weight format {weight_format!r}; "
                         f"known: {', '.join(FORMATS)}")
    values, scales = reference.quantize_int8_per_channel(w)
    return QuantizedWeight(weight_format, values, scales)


def dequantize_weight(weight: QuantizedWeight) -> jax.Array:
    """The float32 `[K, N]` weight a `QuantizedWeight` stands for."""
    if weight.format == "int4":
        return reference.dequantize_int4_grouped(weight.values, weight.scales, weight.zeros,
                                                 weight.group_size)
    return reference.dequantize_int8_per_channel(weight.values, weight.scales)


def _reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    if weight.format == "int8":
        return reference.int8_matmul_reference(x, weight.values, weight.scales,
                                               out_dtype=out_dtype)
    if weight.format == "int4":
        return reference.int4_matmul_reference(x, weight.values, weight.scales, weight.zeros,
                                               weight.group_size, out_dtype=out_dtype)
    return reference.w8a8_matmul_reference(x, weight.values, weight.scales,
                                           out_dtype=out_dtype)


def _kernel(x: jax.Array, weight: QuantizedWeight, out_dtype, interpret) -> jax.Array:
    if weight.format == "int8":
        return kernel.int8_matmul(x, weight.values, weight.scales, out_dtype=out_dtype,
                                  interpret=interpret)
    if weight.format == "int4":
        return kernel.int4_matmul(x, weight.values, weight.scales, weight.zeros,
                                  group_size=weight.group_size, out_dtype=out_dtype,
                                  interpret=interpret)
    return kernel.w8a8_matmul(x, weight.values, weight.scales, out_dtype=out_dtype,
                              interpret=interpret)


def quantized_matmul(
    x: jax.Array,
    weight: QuantizedWeight,
    *,
    implementation: str = "auto",
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """`x @ weight` for a quantized weight.

    Args:
        x: `[..., K]` float32 or bfloat16 activations; leading axes are flattened into
            tokens and restored.
        weight: A `QuantizedWeight` standing for a `[K, N]` matrix.
        implementation: See `pallas_kernels.dispatch`.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[..., N]`.
    """
    choice = dispatch.resolve(implementation)
    k, n = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"quantized_matmul: x has shape {x.shape}, its last axis must be "
                         f"K={k} of the [{k}, {n}] {weight.format} weight")
    leading = x.shape[:-1]
    tokens = x.reshape(-1, k)  # [M, K]
    if choice in ("xla", "reference"):
        out = _reference(tokens, weight, out_dtype)  # [M, N]
    else:
        out = _kernel(tokens, weight, out_dtype, dispatch.interpret_mode(choice))  # [M, N]
    return out.reshape(*leading, n)  # [..., N]
