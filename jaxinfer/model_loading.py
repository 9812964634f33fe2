"""Finding and loading a model by name: an HF directory, a jaxinfer orbax directory, a GGUF
file, a preset.

`load_model` is what the CLI (and later the engine and the `LLM` class) call with the user's
`--model` argument.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import jax

from checkpoints import load_hf_checkpoint, restore_model
from checkpoints.gguf_io import is_gguf_file, read_gguf_config
from checkpoints.hf import CONFIG_FILE, read_hf_config
from checkpoints.orbax_io import CONFIG_FILE as ORBAX_CONFIG_FILE
from checkpoints.orbax_io import read_config as read_orbax_config
from jaxinfer.config import PRESETS, ModelConfig, get_preset
from jaxinfer.models import Transformer, create_model
from jaxinfer.quant.checkpoint import is_quantized_checkpoint, restore_quantized_model
from jaxinfer.quant.gguf import load_gguf_model
from jaxinfer.quant.pre_quantized_loading import (
    is_pre_quantized_checkpoint,
    load_pre_quantized_checkpoint,
    read_checkpoint_scheme,
)

# Models trained by `train_distill` and shipped inside the package (see its README.md).
BUILTIN_DIRECTORY = Path(__file__).parent / "builtin_models"
BUILTIN_MODELS = {"demo": "demo", "demo-draft": "demo_draft"}


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """Maps `builtin:NAME` to its shipped directory; other names are paths.

    Raises:
        FileNotFoundError: An unknown builtin name (the known ones are listed).
    """
    name = str(model)
    if name.startswith("builtin:"):
        builtin = name.removeprefix("builtin:")
        if builtin not in BUILTIN_MODELS:
            raise FileNotFoundError(f"unknown builtin model {builtin!r}; known: "
                                    f"{sorted(BUILTIN_MODELS)}")
        return BUILTIN_DIRECTORY / BUILTIN_MODELS[builtin]
    return Path(name)


logger = logging.getLogger(__name__)


def dtype_overrides(dtype: str | None) -> dict[str, str]:
    """The `ModelConfig` fields a user's `dtype` ("float32", "bfloat16" or None) sets.

    "bfloat16" keeps the parameters in bfloat16 (half the memory, and half the bytes a
    decode step reads). On TPU and GPU it computes in bfloat16 too. XLA:CPU has no fast
    bfloat16 arithmetic: its bfloat16 dots convert element by element, and a bfloat16
    SmolLM2-135M decoded 20-25x slower than its float32 copy. So on the CPU the activations
    stay float32, the matmul kernel (`pallas_kernels.dense_matmul`) reads the bfloat16
    weights as stored, and a warning says so once per process. None keeps the checkpoint's
    parameter dtype.
    """
    if dtype is None:
        return {}
    if dtype == "bfloat16" and jax.default_backend() == "cpu":
        _say_cpu_computes_in_float32()
        return {"param_dtype": "bfloat16", "dtype": "float32"}
    return {"param_dtype": dtype, "dtype": dtype}


@functools.cache
def _say_cpu_computes_in_float32() -> None:
    logger.warning("dtype=bfloat16 on the CPU: parameters are kept in bfloat16 and read as "
                   "stored, activations are computed in float32 (XLA:CPU has no fast "
                   "bfloat16 arithmetic)")


def load_model_config(model: str | os.PathLike[str], **config_overrides: Any) -> ModelConfig:
    """The ModelConfig `load_model(model, **config_overrides)` would build, without weights.

    Lets callers check a model against a mesh (head counts, experts) before loading it.

    Raises:
        FileNotFoundError: As `load_model`.
    """
    name = str(model)
    if name.startswith("random:"):
        return get_preset(name.removeprefix("random:")).replace(**config_overrides)
    path = resolve_model_path(name)
    if is_gguf_file(path):
        return read_gguf_config(path, **config_overrides)
    if (path / CONFIG_FILE).exists():
        read_checkpoint_scheme(path)  # an unsupported quantization config fails here, early
        return read_hf_config(path, **config_overrides)
    if (path / ORBAX_CONFIG_FILE).exists():  # jaxinfer checkpoints, quantized ones too
        return read_orbax_config(path)
    return load_model(model, **config_overrides).config  # raises the informative error


def load_model(model: str | os.PathLike[str], *, mesh: Any = None,
               layout: str = "tensor_parallel", **config_overrides: Any) -> Transformer:
    """Loads `model`.

    Args:
        model: A Hugging Face checkpoint directory (config.json + safetensors; float, or
            pre-quantized GPTQ / AWQ / compressed-tensors, see
            `jaxinfer.quant.pre_quantized`), a directory
            written by `checkpoints.save_model` or by `jaxinfer.quant.save_quantized_model`
            (a quantized model), `builtin:demo` or
            `builtin:demo-draft` (the shipped demo models), a `.gguf` file (Q8_0 / Q4_0 / Q4_1
            projections stay quantized, see `jaxinfer.quant.gguf`), or `random:PRESET` for a
            randomly initialized preset.
        mesh: Optional device mesh to place the parameters on.
        layout: Sharding layout for `mesh`.
        **config_overrides: ModelConfig fields, e.g. `dtype="bfloat16"` (HF directories and
            GGUF files only).

    Raises:
        FileNotFoundError: `model` is neither a model directory nor a known name.
    """
    name = str(model)
    if name.startswith("random:"):
        preset = name.removeprefix("random:")
        config = get_preset(preset)
        if config_overrides:
            config = config.replace(**config_overrides)
        return create_model(config, mesh=mesh, layout=layout)
    path = resolve_model_path(name)
    if is_gguf_file(path):
        return load_gguf_model(path, mesh=mesh, layout=layout, **config_overrides)
    if is_pre_quantized_checkpoint(path):  # GPTQ, AWQ, compressed-tensors
        return load_pre_quantized_checkpoint(path, mesh=mesh, layout=layout,
                                             **config_overrides)
    if (path / CONFIG_FILE).exists():
        return load_hf_checkpoint(path, mesh=mesh, layout=layout, **config_overrides)
    if is_quantized_checkpoint(path):
        if config_overrides:
            raise ValueError(f"{path} is a quantized checkpoint: it loads as saved (no config "
                             f"overrides {sorted(config_overrides)})")
        return restore_quantized_model(path, mesh=mesh, layout=layout)
    if (path / ORBAX_CONFIG_FILE).exists():
        if config_overrides:
            raise ValueError(f"{path}: config overrides {sorted(config_overrides)} apply to "
                             f"Hugging Face directories only")
        return restore_model(path, mesh=mesh, layout=layout)
    state = ("is not a model directory" if path.is_dir() else
             "is not a GGUF file" if path.is_file() else "does not exist")
    raise FileNotFoundError(
        f"model {name!r} {state}: expected a directory with {CONFIG_FILE} (Hugging Face) or "
        f"{ORBAX_CONFIG_FILE} (jaxinfer), a .gguf file, or random:PRESET with PRESET in "
        f"{sorted(PRESETS)}")
