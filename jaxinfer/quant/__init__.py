"""Quantization: integer weight formats applied to a model by rules (RTN, GPTQ, SmoothQuant),
quantized checkpoints, and simulated (fake) quantization for accuracy studies."""

from jaxinfer.quant.config import (
    METHODS,
    QuantizationConfig,
    QuantizationRule,
    WeightScheme,
)
from jaxinfer.quant.fake_quant import (
    PROTOCOLS,
    QuantizationProtocol,
    quantize_asymmetric,
    quantize_model_weights,
    quantize_symmetric,
    simulate,
)
from jaxinfer.quant.linear import (
    LinearSite,
    QuantizedLinear,
    dequantize_model,
    linear_sites,
    linear_weight_bytes,
    quantize_model,
)

__all__ = ["METHODS", "PROTOCOLS", "LinearSite", "QuantizationConfig", "QuantizationProtocol",
           "QuantizationRule", "QuantizedLinear", "WeightScheme", "dequantize_model",
           "linear_sites", "linear_weight_bytes", "quantize_asymmetric", "quantize_model",
           "quantize_model_weights", "quantize_symmetric", "simulate"]
