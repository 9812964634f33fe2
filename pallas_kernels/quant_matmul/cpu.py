"""The CPU kernel of weight-quantized matmuls at decode sizes: `cpu_quant_matmul.cc` over XLA FFI.

Off TPU, the XLA path of a quantized weight (`reference.py`) dequantizes the whole matrix to
float32 every step and then multiplies, so a 4-bit model read and wrote several times its
own bytes per token and ran slower than its float32 original. The C++ kernel streams the
stored bytes (int4 nibbles, int8 levels) and dequantizes in registers, scaling once per
group. It serves "int4" (symmetric or with int8 / float32 zero points: GGUF Q4_0 / Q4_1,
GPTQ, RTN), "int8" (per channel) and "int8_grouped" (GGUF Q8_0) weights times float32
activations of at most `MAX_ROWS` rows (decode steps, speculative verification); longer
products (prefill) keep XLA's path, where the dequantized copy is amortized over many rows.

A weight may be one matrix or a stack of them with a layer index (inside a scan over layers,
`jaxinfer.models.scan`), read in place like `pallas_kernels.dense_matmul`.

The source is built on first use by `pallas_kernels.cpu_build`; where it cannot be built, or
the CPU lacks AVX2 + FMA (the vector path), `available()` is False and XLA's path runs.
`JAXINFER_CPU_KERNELS=0` turns it off; `disabled()` does so while tracing.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build, top_k
from pallas_kernels.quant_matmul import formats

SOURCE = pathlib.Path(__file__).with_name("cpu_quant_matmul.cc")
_TARGET = "QuantMatmul"
_MANY_TARGET = "QuantMatmulMany"
# Rows up to which the kernel runs. Each pair of rows decodes the weight again from L1, while
# XLA's path dequantizes once and then multiplies at its large-product rate, so the kernel's
# lead shrinks with rows; prefill buckets (128 rows and up) keep XLA's path.
MAX_ROWS = 64
FORMATS = {"int4": True, "int8": False, "int8_grouped": False}
_switch = cpu_build.KernelSwitch()
# Within `with disabled():` (while tracing), `supports` is False: XLA's path runs instead.
disabled = _switch.disabled


@functools.cache
def available() -> bool:
    """Whether the kernel is built, registered and vectorized for this CPU (False, with one
    warning, if it cannot be built, or with `JAXINFER_CPU_KERNELS=0`)."""
    return cpu_build.kernel_available(SOURCE, [_TARGET, _MANY_TARGET], kernel="quantized-matmul",
                                      fallback="XLA's path",
                                      vectorized="JaxinferQuantMatmulVectorized")


def supports(x: jax.Array, weight_format: str, values: jax.Array) -> bool:
    """Whether the kernel takes `x [..., I]` times a weight of `weight_format` whose stored
    `values` are `[I', O]` (or a stack `[L, I', O]`).

    Only while tracing (inside jit): eagerly, each call would compile its own small programs
    per shape, where the XLA path is one cached op.
    """
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    traced = isinstance(x, jax.core.Tracer) or isinstance(values, jax.core.Tracer)
    return (traced and not _switch.off and jax.default_backend() == "cpu"
            and weight_format in FORMATS and values.ndim in (2, 3)
            and x.dtype == jnp.float32 and 0 < rows <= MAX_ROWS
            and cpu_build.single_device() and available())


# Products of at most this many rows quantize their activations to int8 by default (the
# "decode" setting): decode steps of a few sequences, where the weight read is the whole
# cost and the float register walk is bound by widening weights (`cpu_quant_matmul.cc`).
DECODE_ROWS = 4
# Rows from which float activations multiply a dequantized panel of the weight
# (`RunPanels`: the weight decoded once, then a register-blocked float product) instead of
# decoding it again for every pair of rows (the register walk). From 5-8 rows on the panel
# ran as fast as int8 activations or faster, and it is exact where they round, so int8
# activations stop at `DECODE_ROWS` (`benchmarks/cpu_kernel_rows.py`).
PANEL_ROWS = DECODE_ROWS + 1
_INT8_ACTIVATIONS = {"1": "on", "on": "on", "true": "on", "0": "off", "off": "off",
                     "false": "off", "decode": "decode"}


def int8_activations_by_default(rows: int) -> bool:
    """Whether a product of `rows` rows quantizes its activations to int8 unless told
    otherwise, as `$JAXINFER_CPU_INT8_ACTIVATIONS` says:

    - "decode" (the default): products of at most `DECODE_ROWS` rows. A prompt's prefill
      keeps float activations: on SmolLM2-135M (strong outlier channels) int8 activations in
      the prompt's projections moved the greedy answer to "What is the capital of France?"
      off "Paris", where float prefill keeps transformers' tokens.
    - "1" / "on" / "true": every product the kernel takes (up to `MAX_ROWS` rows), as
      llama.cpp quantizes every activation of a Q4/Q8 weight;
    - "0" / "off" / "false": none (float32 activations, the reference up to summation order).

    Raises:
        ValueError: Another value (naming the variable).
    """
    value = os.environ.get("JAXINFER_CPU_INT8_ACTIVATIONS", "decode").strip().lower()
    if value not in _INT8_ACTIVATIONS:
        raise ValueError(f"JAXINFER_CPU_INT8_ACTIVATIONS={value!r}: use decode, on or off")
    setting = _INT8_ACTIVATIONS[value]
    return setting == "on" or (setting == "decode" and rows <= DECODE_ROWS)


def matmul(x: jax.Array, weight_format: str, values: jax.Array, scales: jax.Array,
           zeros: jax.Array | None, group_size: int | None, *,
           layer: jax.Array | int | None = None,
           int8_activations: bool | None = None, exact_top: int = 0) -> jax.Array:
    """`x @ dequantize(weight)` through the kernel; check `supports` first.

    Args:
        x: `[..., I]` float32 activations.
        weight_format: "int4", "int8" or "int8_grouped".
        values: `[I // 2, O]` packed nibbles (int4) or `[I, O]` int8; with `layer`, a stack
            `[L, I', O]` of which `values[layer]` is multiplied.
        scales: `[O]` (per channel), `[C, O]` (grouped), or stacked `[L, ...]` likewise.
        zeros: int4 zero points `[C, O]` (int8 or float32; stacked with `layer`), or None.
        group_size: Rows per scale group; None for per-channel "int8".
        layer: Index into the stacks, or None for single matrices.
        int8_activations: Quantize `x` per row and block of 32 features to int8 and sum the
            products in integers (`reference.int8_activation_matmul` is the rule), as
            llama.cpp multiplies its Q4/Q8 weights by Q8 activations: 2-3x the float path's
            rate on AVX2. Applies where the group size is a multiple of 32 and O of 32; the
            float path (exact to the reference up to summation order) elsewhere. None:
            `int8_activations_by_default(rows)`.
        exact_top: With int8 activations, the `exact_top` largest outputs of each row (by
            the int8 result) are computed again with float32 activations (`_exact_top`):
            an LM head's greedy token is then the float path's, at the int8 path's speed.
            0: none.

    Returns:
        `[..., O]` float32.
    """
    if layer is None:
        values, scales = values[None], scales[None]  # [1, I', O], [1, ...]
        zeros = None if zeros is None else zeros[None]  # [1, C, O]
    columns = values.shape[-1]
    flat = x.reshape(-1, x.shape[-1])  # [M, I]
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)  # [1]
    quantize = bool(int8_activations_by_default(flat.shape[0]) if int8_activations is None
                    else int8_activations)
    out = _matmul(flat, values, scales, zeros, index, weight_format, group_size,
                  quantize)  # [M, O]
    if quantize and exact_top > 0:
        out = _exact_top(flat, out, values, scales, zeros, index, weight_format, group_size,
                         min(exact_top, columns))  # [M, O]
    return out.reshape(*x.shape[:-1], columns)  # [..., O]


def _exact_top(x: jax.Array, approximate: jax.Array, values: jax.Array, scales: jax.Array,
               zeros: jax.Array | None, layer: jax.Array, weight_format: str,
               group_size: int | None, top: int) -> jax.Array:
    """`approximate` (`x @ W` with int8 activations) with each row's `top` largest entries
    replaced by the float reference's values for those columns.

    The int8 rounding of a block of 32 features is coarse next to an outlier feature, and an
    LM head's argmax is where it shows first: on SmolLM2-135M's final hidden states (README
    text, 1000 positions) it moved the argmax at 2% of positions, and the float argmax was
    always among the int8 result's top 3. Recomputing the top `top` columns (a gather of
    `top` columns per row, `[I, M * top]`) makes the greedy token the float path's while
    the whole matrix is still read by the int8 path.

    Args:
        x: `[M, I]` float32 activations.
        approximate: `[M, O]` the int8-activation product.
        values, scales, zeros: The stacks as `_call` takes them; `layer` `[1]` picks one.
        top: Columns per row to recompute, at most O.

    Returns:
        `[M, O]` float32.
    """
    rows = x.shape[0]
    _, columns = top_k.top_k(approximate, top)  # [M, T]
    flat = columns.reshape(-1)  # [M * T]

    def gather(stack: jax.Array) -> jax.Array:
        matrix = jax.lax.dynamic_index_in_dim(stack, layer[0], keepdims=False)  # [..., O]
        return jnp.take(matrix, flat, axis=-1)  # [..., M * T]

    picked = formats.QuantizedWeight(weight_format, gather(values), gather(scales),
                                     None if zeros is None else gather(zeros), group_size)
    products = formats.get_format(weight_format).reference_matmul(
        x, picked, jnp.float32)  # [M, M * T]
    own = jnp.arange(rows)  # [M]
    exact = products.reshape(rows, rows, top)[own, own]  # [M, T] row m's own columns
    return approximate.at[own[:, None], columns].set(exact)  # [M, O]


def _call(x: jax.Array, values: jax.Array, scales: jax.Array, zeros: jax.Array | None,
          layer: jax.Array, weight_format: str, group_size: int | None,
          int8_activations: bool) -> jax.Array:
    """The custom call on a stack: `[M, I]` x, `[L, I', O]` values, `[L, ...]` scales and
    zeros, `[1]` layer -> `[M, O]` float32."""
    if not available():  # also registers the FFI target on first use
        raise RuntimeError("the CPU quantized-matmul kernel is unavailable on this machine")
    columns = values.shape[-1]
    scales = scales.reshape(scales.shape[0], -1, columns)  # [L, C, O] (C = 1 per channel)
    # int8 or float32 zero points go in as stored (the kernel widens one layer's int8).
    zero_points = jnp.zeros((1,), jnp.float32) if zeros is None else zeros  # [L, C, O] or [1]
    call = jax.ffi.ffi_call(f"jaxinfer_{_TARGET}",
                            jax.ShapeDtypeStruct((x.shape[0], columns), jnp.float32),
                            vmap_method="sequential")
    return call(x, values, scales, zero_points, layer, int4=FORMATS[weight_format],
                has_zeros=zeros is not None, group_size=np.int64(group_size or x.shape[-1]),
                int8_activations=int8_activations,
                num_threads=np.int32(cpu_build.num_threads()),
                panel_rows=np.int64(PANEL_ROWS))  # [M, O]


def _layer_reference(x: jax.Array, values: jax.Array, scales: jax.Array,
                     zeros: jax.Array | None, layer: jax.Array, weight_format: str,
                     group_size: int | None) -> jax.Array:
    """The float reference of one layer of the stack (what gradients differentiate)."""
    pick = functools.partial(jax.lax.dynamic_index_in_dim, index=layer[0], keepdims=False)
    weight = formats.QuantizedWeight(weight_format, pick(values), pick(scales),
                                     None if zeros is None else pick(zeros), group_size)
    return formats.get_format(weight_format).reference_matmul(x, weight, jnp.float32)  # [M, O]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _matmul(x, values, scales, zeros, layer, weight_format, group_size, int8_activations):
    return _call(x, values, scales, zeros, layer, weight_format, group_size, int8_activations)


def _matmul_forward(x, values, scales, zeros, layer, weight_format, group_size,
                    int8_activations):
    out = _call(x, values, scales, zeros, layer, weight_format, group_size, int8_activations)
    return out, (x, values, scales, zeros, layer)


def _matmul_backward(weight_format, group_size, int8_activations, saved, grad):
    # Gradients of the float reference (with int8 activations, a straight-through estimate):
    # for x, the scales and float zero points; integer arrays get none.
    x, values, scales, zeros, layer = saved
    floats = (x, scales) + ((zeros,) if zeros is not None and jnp.issubdtype(
        zeros.dtype, jnp.floating) else ())

    def reference(x, scales, *float_zeros):
        return _layer_reference(x, values, scales, float_zeros[0] if float_zeros else zeros,
                                layer, weight_format, group_size)

    _, pullback = jax.vjp(reference, *floats)
    grads = pullback(grad)
    zeros_grad = None if zeros is None else (
        grads[2] if len(grads) == 3 else np.zeros(zeros.shape, jax.dtypes.float0))
    return (grads[0], np.zeros(values.shape, jax.dtypes.float0), grads[1], zeros_grad,
            np.zeros(layer.shape, jax.dtypes.float0))


_matmul.defvjp(_matmul_forward, _matmul_backward)


def matmul_many(x: jax.Array, weight_format: str,
                weights: Sequence[tuple[jax.Array, jax.Array, jax.Array | None]],
                group_size: int | None, *, layer: jax.Array | int | None = None,
                int8_activations: bool | None = None) -> list[jax.Array]:
    """`[x @ dequantize(w) for w in weights]` in one kernel call (check `supports` for each
    weight first): x is quantized once and the threads split every weight's groups in one
    pass, so a layer's q, k and v projections (or its gate and up) start and join the threads
    once. The same weight format, group size and zero-point presence for every weight.

    Args:
        x: `[..., I]` float32 activations.
        weight_format: As `matmul`.
        weights: `(values, scales, zeros)` of each weight, as `matmul` takes them (stacks
            `[L, ...]` with `layer`).
        group_size, layer, int8_activations: As `matmul` (no exact top).

    Returns:
        `[..., O_i]` float32 for each weight.
    """
    if layer is None:
        weights = [(values[None], scales[None], None if zeros is None else zeros[None])
                   for values, scales, zeros in weights]  # [1, I', O], [1, ...], [1, C, O]
    if len({zeros is None for _, _, zeros in weights}) != 1:
        raise ValueError("matmul_many takes weights all with zero points or all without")
    flat = x.reshape(-1, x.shape[-1])  # [M, I]
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)  # [1]
    quantize = bool(int8_activations_by_default(flat.shape[0]) if int8_activations is None
                    else int8_activations)
    outs = _matmul_many(flat, tuple(weights), index, weight_format, group_size,
                        quantize)  # [M, O_i] each
    return [out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs]  # [..., O_i] each


def _call_many(x, weights, layer, weight_format, group_size, int8_activations):
    """The custom call of several weights of one x: `[M, I]` x, `((values, scales, zeros)
    ...)` stacks, `[1]` layer -> `[M, O_i]` float32 each."""
    if not available():  # also registers the FFI targets on first use
        raise RuntimeError("the CPU quantized-matmul kernel is unavailable on this machine")
    arrays, shapes = [], []
    for values, scales, zeros in weights:
        columns = values.shape[-1]
        arrays += [values, scales.reshape(scales.shape[0], -1, columns),  # [L, C, O]
                   jnp.zeros((1,), jnp.float32) if zeros is None else zeros]
        shapes.append(jax.ShapeDtypeStruct((x.shape[0], columns), jnp.float32))
    call = jax.ffi.ffi_call(f"jaxinfer_{_MANY_TARGET}", tuple(shapes), vmap_method="sequential")
    return tuple(call(x, layer, *arrays, int4=FORMATS[weight_format],
                      has_zeros=weights[0][2] is not None,
                      group_size=np.int64(group_size or x.shape[-1]),
                      int8_activations=int8_activations,
                      num_threads=np.int32(cpu_build.num_threads()),
                      panel_rows=np.int64(PANEL_ROWS)))  # [M, O_i] each


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmul_many(x, weights, layer, weight_format, group_size, int8_activations):
    return _call_many(x, weights, layer, weight_format, group_size, int8_activations)


def _matmul_many_forward(x, weights, layer, weight_format, group_size, int8_activations):
    out = _call_many(x, weights, layer, weight_format, group_size, int8_activations)
    return out, (x, weights, layer)


def _matmul_many_backward(weight_format, group_size, int8_activations, saved, grads):
    # Each weight's gradients as `_matmul_backward` gives them; x's are summed.
    x, weights, layer = saved
    x_grad, weight_grads = jnp.zeros_like(x), []
    for (values, scales, zeros), grad in zip(weights, grads, strict=True):
        x_part, values_grad, scales_grad, zeros_grad, layer_grad = _matmul_backward(
            weight_format, group_size, int8_activations, (x, values, scales, zeros, layer), grad)
        x_grad = x_grad + x_part  # [M, I]
        weight_grads.append((values_grad, scales_grad, zeros_grad))
    return x_grad, tuple(weight_grads), layer_grad


_matmul_many.defvjp(_matmul_many_forward, _matmul_many_backward)
