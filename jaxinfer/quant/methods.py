"""One entry point for every quantization method: `apply_method(model, config, windows)`."""

from __future__ import annotations

import numpy as np

from jaxinfer.models import Transformer
from jaxinfer.quant.calibration import calibration_windows
from jaxinfer.quant.config import QuantizationConfig
from jaxinfer.quant.gptq import gptq_quantize_model
from jaxinfer.quant.linear import quantize_model
from jaxinfer.quant.smoothquant import smoothquant_model

__all__ = ["apply_method", "calibration_windows"]


def apply_method(model: Transformer, config: QuantizationConfig,
                 windows: np.ndarray | None = None, *,
                 implementation: str = "auto") -> Transformer:
    """Quantizes a copy of `model` with `config.method`.

    Args:
        model: The float model (left unchanged).
        config: Method, rules and the method's settings.
        windows: `[B, T]` calibration token ids; needed by "gptq" and "smoothquant".
        implementation: The quantized layers' `pallas_kernels.dispatch` choice.

    Raises:
        ValueError: A calibrated method without windows, a weight that does not fit, or
            "sparsegpt" (made by `jaxinfer.prune.prune_model`).
    """
    if config.method == "sparsegpt":
        raise ValueError("joint SparseGPT pruning + quantization is jaxinfer.prune's "
                         "prune_model (PruningConfig with quantization)")
    if config.method == "rtn":
        return quantize_model(model, config, implementation=implementation)
    if windows is None:
        raise ValueError(f"method {config.method!r} needs calibration windows")
    if config.method == "gptq":
        return gptq_quantize_model(model, config, windows, implementation=implementation)
    return smoothquant_model(model, config, windows, implementation=implementation)
