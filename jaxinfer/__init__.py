"""jaxinfer: a JAX/XLA inference stack for Llama-family language models on TPUs and GPUs."""

from jaxinfer.config import PRESETS, ConfigError, ModelConfig, RopeScaling, get_preset

__version__ = "0.1.0"

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "RopeScaling", "__version__", "get_preset"]
