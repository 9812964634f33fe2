"""Quantization: integer weight formats applied to a model by rules (RTN, GPTQ, SmoothQuant),
quantized checkpoints, and simulated (fake) quantization for accuracy studies."""

from jaxinfer.quant.checkpoint import (
    is_quantized_checkpoint,
    restore_quantized_model,
    save_quantized_model,
)
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
from jaxinfer.quant.gptq import gptq_quantize, gptq_quantize_model
from jaxinfer.quant.kv_cache import (
    int8_round_trip,
    kivi_round_trip,
    kv_bytes_per_token,
    scaled_round_trip,
)
from jaxinfer.quant.linear import (
    LinearSite,
    QuantizedLinear,
    dequantize_model,
    linear_sites,
    linear_weight_bytes,
    quantize_model,
)
from jaxinfer.quant.methods import apply_method, calibration_windows
from jaxinfer.quant.smoothquant import smooth_model, smoothquant_model

__all__ = ["METHODS", "PROTOCOLS", "LinearSite", "QuantizationConfig", "QuantizationProtocol",
           "QuantizationRule", "QuantizedLinear", "WeightScheme", "apply_method",
           "calibration_windows", "dequantize_model", "gptq_quantize", "gptq_quantize_model",
           "int8_round_trip", "is_quantized_checkpoint", "kivi_round_trip", "kv_bytes_per_token",
           "linear_sites", "linear_weight_bytes", "quantize_asymmetric", "quantize_model",
           "quantize_model_weights", "quantize_symmetric", "restore_quantized_model",
           "save_quantized_model", "scaled_round_trip", "simulate", "smooth_model",
           "smoothquant_model"]
