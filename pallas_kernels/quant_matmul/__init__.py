"""Weight-quantized matmul: the public op and the weight pytree it takes.

`quantize_weight` turns a float `[I, O]` weight into a `QuantizedWeight` once, at load
time; `quantized_matmul(x, weight)` multiplies activations by it. Which formats exist, and
how each is quantized, dequantized and multiplied, is the registry in `formats.py`
(built in: "int8", "int4", "w8a8", "int8_grouped", the 2:4 sparse "sparse24",
"sparse24_int8", "sparse24_int4", and "fp8"); these ops look the weight's format up there.

`implementation=` follows `pallas_kernels.dispatch`: "xla" runs the C++ CPU kernel
(`cpu.py`, int4 / int8 / int8_grouped at decode row counts) where it takes the product and
the jnp reference otherwise, "reference" always the jnp reference, "pallas" the compiled TPU
kernel, "interpret" the kernel in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.quant_matmul import cpu
from pallas_kernels.quant_matmul.formats import (
    QuantizedWeight,
    WeightFormat,
    get_format,
    register_format,
    registered_formats,
    unregister_format,
)

__all__ = ["FORMATS", "QuantizedWeight", "WeightFormat", "dequantize_weight", "get_format",
           "quantize_weight", "quantized_matmul", "register_format", "registered_formats",
           "unregister_format"]

# The built-in formats; `registered_formats()` also lists any registered later.
FORMATS = registered_formats()


def quantize_weight(
    w: jax.Array, weight_format: str, *, group_size: int = 128, symmetric: bool = True,
    bits: int | None = None,
) -> QuantizedWeight:
    """Quantizes a float `[I, O]` weight (round to nearest).

    Args:
        w: `[I, O]` float weight (input features by output features).
        weight_format: A registered format name: "int8", "int4", "w8a8", ...
        group_size: Rows per scale group (grouped formats only; ignored by the others).
        symmetric: False gives zero points (formats that hold them; ignored by the others).
        bits: A bit width the format holds (for "int4": 4, 3 or 2); None: its default.

    Returns:
        The `QuantizedWeight`.

    Raises:
        ValueError: An unknown format, or bits the format does not hold.
    """
    spec = get_format(weight_format, "quantized weight format")
    bits = spec.bits[0] if bits is None else bits
    group_size = group_size if spec.grouped else None
    symmetric = symmetric or not spec.zero_points
    spec.check_options(bits, group_size, symmetric)
    return spec.quantize(w, bits, group_size, symmetric)


def dequantize_weight(weight: QuantizedWeight) -> jax.Array:
    """The float32 `[I, O]` weight a `QuantizedWeight` stands for."""
    return get_format(weight.format).dequantize(weight)


def quantized_matmul(
    x: jax.Array,
    weight: QuantizedWeight,
    *,
    implementation: str = "auto",
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """`x @ weight` for a quantized weight.

    Args:
        x: `[..., I]` float32 or bfloat16 activations; leading axes are flattened into
            tokens and restored.
        weight: A `QuantizedWeight` standing for a `[I, O]` matrix.
        implementation: See `pallas_kernels.dispatch`.
        out_dtype: Result dtype; defaults to the dtype of `x`.

    Returns:
        `[..., O]`.
    """
    choice = dispatch.resolve(implementation)
    spec = get_format(weight.format)
    k, n = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"quantized_matmul: x has shape {x.shape}, its last axis must be "
                         f"K={k} of the [{k}, {n}] {weight.format} weight")
    leading = x.shape[:-1]
    tokens = x.reshape(-1, k)  # [T, I]
    if choice == "xla" and out_dtype in (None, jnp.float32) and cpu.supports(
            tokens, weight.format, weight.values):
        out = cpu.matmul(tokens, weight.format, weight.values, weight.scales, weight.zeros,
                         weight.group_size)  # [T, O]
    elif choice in ("xla", "reference"):
        out = spec.reference_matmul(tokens, weight, out_dtype)  # [T, O]
    else:
        out = spec.kernel_matmul(tokens, weight, out_dtype,
                                 dispatch.interpret_mode(choice))  # [T, O]
    return out.reshape(*leading, n)  # [..., O]
