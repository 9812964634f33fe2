"""A weight format registered by the test alone (no other file knows it) works end to end:
scheme checks, `quantize_model`, the model's forward through its reference and its kernel,
and a quantized checkpoint that restores it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.quant import (
    QuantizationConfig,
    QuantizationRule,
    QuantizedLinear,
    WeightScheme,
    dequantize_model,
    linear_sites,
    quantize_model,
    restore_quantized_model,
    save_quantized_model,
)
from pallas_kernels import dispatch
from pallas_kernels.quant_matmul import (
    QuantizedWeight,
    WeightFormat,
    kernel,
    register_format,
    unregister_format,
)

NAME = "toy-int8-per-tensor"


def _quantize(w: jax.Array, bits: int, group_size: int | None,
              symmetric: bool) -> QuantizedWeight:
    w = w.astype(jnp.float32)  # [K, N]
    scale = jnp.maximum(jnp.max(jnp.abs(w)), 1e-12) / 127  # one scale for the whole matrix
    values = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)  # [K, N]
    return QuantizedWeight(NAME, values, scale.reshape(1))


def _dequantize(weight: QuantizedWeight) -> jax.Array:
    return weight.values.astype(jnp.float32) * weight.scales[0]  # [K, N]


def _reference(x: jax.Array, weight: QuantizedWeight, out_dtype) -> jax.Array:
    product = jnp.matmul(x.astype(jnp.float32), _dequantize(weight),
                         precision=jax.lax.Precision.HIGHEST)  # [M, N]
    return product.astype(out_dtype or x.dtype)


def _kernel(x: jax.Array, weight: QuantizedWeight, out_dtype, interpret) -> jax.Array:
    # Its "kernel" is the int8 one with the one scale repeated per channel.
    scales = jnp.broadcast_to(weight.scales, (weight.values.shape[1],))  # [N]
    return kernel.int8_matmul(x, weight.values, scales, out_dtype=out_dtype,
                              interpret=interpret)


TOY = WeightFormat(name=NAME, bits=(8,), grouped=False, zero_points=False,
                   quantize=_quantize, dequantize=_dequantize, reference_matmul=_reference,
                   kernel_matmul=_kernel)


@pytest.fixture
def toy_format():
    register_format(TOY)
    yield TOY
    unregister_format(NAME)


def _relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def test_unregistered_formats_are_rejected():
    with pytest.raises(ValueError, match="unknown weight format"):
        WeightScheme(format=NAME)


def test_a_format_registered_here_quantizes_runs_and_restores(toy_format, tmp_path):
    with pytest.raises(ValueError, match="8-bit"):
        WeightScheme(format=NAME, bits=4)
    config = QuantizationConfig(method="rtn", rules=(
        QuantizationRule(r"lm_head$", None),
        QuantizationRule(r"\.down_proj$", WeightScheme(format="int8")),  # mixed with a built-in
        QuantizationRule(r".", WeightScheme(format=NAME)),
    ))
    model = create_model(get_preset("tiny"), seed=0)
    quantized = quantize_model(model, config)
    formats = {site.path: site.layer.format for site in linear_sites(quantized)
               if isinstance(site.layer, QuantizedLinear)}
    assert formats["layers.0.attention.o_proj"] == NAME
    assert formats["layers.1.mlp.down_proj"] == "int8" and "lm_head" not in formats
    assert quantized.layers[0].attention.q_proj.scales[...].shape == (1,)

    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 512)  # [B, T]
    expected, _ = dequantize_model(quantized)(tokens)  # [B, T, V]
    actual, _ = quantized(tokens)  # [B, T, V] through the toy reference
    assert _relative_error(actual, expected) < 1e-5
    with dispatch.force_implementation("interpret"):
        interpreted, _ = quantized(tokens)  # [B, T, V] through the toy kernel
    assert _relative_error(interpreted, expected) < 1e-5
    original, _ = model(tokens)
    assert _relative_error(actual, original) < 0.05

    directory = save_quantized_model(quantized, config, tmp_path / "toy")
    restored = restore_quantized_model(directory)
    assert restored.layers[1].attention.k_proj.format == NAME
    np.testing.assert_array_equal(np.asarray(restored(tokens)[0]), np.asarray(actual))
