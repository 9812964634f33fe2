"""jaxinfer: a JAX/XLA inference stack for Llama-family language models on TPUs and GPUs.

    from jaxinfer import LLM, SamplingParams
    llm = LLM(model="builtin:demo")
    print(llm.generate("The list type", SamplingParams(max_tokens=32))[0].outputs[0].text)

The serving names (`LLM`, `SamplingParams`, `AsyncEngine`, ...) are imported on first use, so
`import jaxinfer` (and the `jaxinfer --help` command line) stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxinfer.config import PRESETS, ConfigError, ModelConfig, RopeScaling, get_preset
from jaxinfer.host_allocator import tune_host_allocator

# Before XLA starts its threads: see `jaxinfer.host_allocator`.
tune_host_allocator()

__version__ = "0.1.0"

# Public name -> the module that defines it.
_LAZY = {
    "LLM": "jaxinfer.llm",
    "SamplingParams": "jaxinfer.engine.sampling_params",
    "StructuredOutputsParams": "jaxinfer.engine.sampling_params",
    "RequestOutput": "jaxinfer.engine.outputs",
    "CompletionOutput": "jaxinfer.engine.outputs",
    "Engine": "jaxinfer.engine.core",
    "EngineConfig": "jaxinfer.engine.core",
    "AsyncEngine": "jaxinfer.engine.async_engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")


__all__ = ["PRESETS", "ConfigError", "ModelConfig", "RopeScaling", "__version__", "get_preset",
           *_LAZY]
