"""Quantization: simulated (fake) quantization for accuracy studies; integer paths to come."""

from jaxinfer.quant.fake_quant import (
    PROTOCOLS,
    QuantizationProtocol,
    quantize_asymmetric,
    quantize_model_weights,
    quantize_symmetric,
    simulate,
)

__all__ = ["PROTOCOLS", "QuantizationProtocol", "quantize_asymmetric", "quantize_model_weights",
           "quantize_symmetric", "simulate"]
