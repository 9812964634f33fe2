"""Loading a pre-quantized Hugging Face checkpoint (GPTQ, AWQ, compressed-tensors) as a model
with `QuantizedLinear` layers, on one device or split over a mesh.

Like the float loader (`checkpoints.hf.load_hf_checkpoint`), it builds the abstract model
first, here with a `QuantizedLinear` at every module the checkpoint holds quantized (its
layout follows from the config alone, `pre_quantized.repacked_shapes`), computes every
array's sharding from the logical axes (a quantized layer is split like the float weight it
replaces), then reads and converts one module at a time and puts its arrays straight onto
their devices, so host memory peaks near one module. Float tensors (embedding, norms,
biases, the LM head, modules left unquantized) convert exactly as the float loader does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from checkpoints.hf import CONFIG_FILE, CheckpointMismatchError, read_hf_config
from checkpoints.hf_mapping import IGNORED_SUFFIXES, TensorMapping, tensor_mappings
from checkpoints.safetensors_io import CheckpointFiles
from jaxinfer.config import ModelConfig
from jaxinfer.models import Transformer
from jaxinfer.models.layers import dtype_of
from jaxinfer.quant.checkpoint import ModelFiller
from jaxinfer.quant.linear import linear_sites
from jaxinfer.quant.pre_quantized import (
    QUANTIZATION_CONFIG,
    PreQuantizedScheme,
    RepackedWeight,
    module_tensor_names,
    read_pre_quantized_scheme,
    read_repacked_weight,
    repacked_shapes,
)
from pallas_kernels.quant_matmul import QuantizedWeight

ARRAY_FIELDS = ("values", "scales", "zeros", "input_permutation")


def _hf_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def is_pre_quantized_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` is a Hugging Face checkpoint whose config.json has a
    `quantization_config` (supported or not: `read_checkpoint_scheme` says which)."""
    return QUANTIZATION_CONFIG in _hf_config(Path(directory))


def read_checkpoint_scheme(directory: str | os.PathLike[str]) -> PreQuantizedScheme | None:
    """The checkpoint's scheme, or None for a float checkpoint.

    Raises:
        ValueError: The quantization config is one we cannot load (the key is named).
    """
    return read_pre_quantized_scheme(_hf_config(Path(directory)))


def _module_prefix(mapping: TensorMapping) -> str | None:
    """The HF module of a linear weight mapping (`...q_proj` of `...q_proj.weight`)."""
    if len(mapping.hf_names) != 1 or not mapping.hf_names[0].endswith(".weight"):
        return None
    return mapping.hf_names[0].removesuffix(".weight")


def _site_path(mapping: TensorMapping) -> str:
    return ".".join(str(part) for part in mapping.param_path)


def _quantized_modules(scheme: PreQuantizedScheme, files: CheckpointFiles,
                       mappings: list[TensorMapping], directory: Path
                       ) -> dict[str, tuple[str, int, int]]:
    """Site path -> (HF module, I, O) of every module the checkpoint holds quantized."""
    quantized = {}
    for mapping in mappings:
        prefix = _module_prefix(mapping)
        if prefix is None:
            for name in mapping.hf_names:
                if scheme.quantized_marker(name.removesuffix(".weight")) in files:
                    raise ValueError(f"{directory}: {name.removesuffix('.weight')} is "
                                     "quantized; quantized MoE experts are not supported")
            continue
        if scheme.quantized_marker(prefix) in files:
            output_features, input_features = mapping.hf_shapes[0]  # HF linear: [O, I]
            quantized[_site_path(mapping)] = (prefix, input_features, output_features)
    return quantized


def _abstract_model(config: ModelConfig, layouts: dict[str, RepackedWeight]) -> Transformer:
    """The model with a `QuantizedLinear` of each layout at its site, shapes only."""

    def build() -> Transformer:
        model = Transformer(config, rngs=nnx.Rngs(0))
        sites = {site.path: site for site in linear_sites(model)}
        for path, layout in layouts.items():
            if path not in sites:
                raise ValueError(f"{path} is quantized in the checkpoint, but it is no "
                                 "linear layer we can quantize")
            zeros = None if layout.zeros is None else jnp.zeros(layout.zeros.shape, jnp.int8)
            weight = QuantizedWeight(
                layout.format, jnp.zeros(layout.values.shape, layout.values.dtype),
                jnp.zeros(layout.scales.shape, jnp.float32), zeros, layout.group_size,
                layout.bits)  # [I // 2, O] or [I, O], [C, O] or [O], [C, O]
            permutation = (None if layout.input_permutation is None else
                           jnp.zeros(layout.input_permutation.shape, jnp.int32))  # [I]
            sites[path].quantize(weight, input_permutation=permutation)
        return model

    return nnx.eval_shape(build)


def load_pre_quantized_checkpoint(
    directory: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    layout: str | tuple = "tensor_parallel",
    **config_overrides: Any,
) -> Transformer:
    """Loads a GPTQ, AWQ or compressed-tensors checkpoint directory.

    Args:
        directory: config.json (with `quantization_config`) and safetensors weights.
        mesh: Place the arrays on this mesh under `layout`; None: the default device.
        layout: Sharding layout name or rules table.
        **config_overrides: ModelConfig fields (they apply to the float parameters and
            the activations; quantized layers keep their formats).

    Raises:
        ValueError: An unsupported quantization config (the key is named) or tensors that
            contradict it.
        CheckpointMismatchError: Missing, unexpected or mis-shaped tensors.
    """
    directory = Path(directory)
    scheme = read_checkpoint_scheme(directory)
    if scheme is None:
        raise ValueError(f"{directory}: {CONFIG_FILE} has no {QUANTIZATION_CONFIG}")
    config = read_hf_config(directory, **config_overrides)
    mappings = tensor_mappings(config)
    param_dtype = dtype_of(config.param_dtype)
    with CheckpointFiles(directory) as files:
        quantized = _quantized_modules(scheme, files, mappings, directory)
        layouts = {path: repacked_shapes(scheme, k, n) for path, (_, k, n) in quantized.items()}
        filler = ModelFiller(_abstract_model(config, layouts), mesh, layout)

        def read(name: str) -> np.ndarray:
            if name not in files:
                raise CheckpointMismatchError(f"{directory}: tensor {name!r} is missing")
            return files.read(name)

        consumed: set[str] = set()
        for mapping in mappings:
            path = _site_path(mapping)
            if path in quantized:
                prefix, k, n = quantized[path]
                repacked = read_repacked_weight(scheme, read, files.__contains__, prefix, k, n)
                for field in ARRAY_FIELDS:
                    if getattr(repacked, field) is not None:
                        filler.put(mapping.param_path + (field,), getattr(repacked, field))
                consumed.update(module_tensor_names(scheme, prefix))
                consumed.add(_zero_bias(read, files, prefix))
                continue
            for name, shape in zip(mapping.hf_names, mapping.hf_shapes):
                if name not in files:
                    raise CheckpointMismatchError(f"{directory}: tensor {name!r} is missing")
                if files.shape(name) != shape:
                    raise CheckpointMismatchError(
                        f"{directory}: tensor {name!r} has shape {files.shape(name)} in the "
                        f"checkpoint but the config implies {shape}")
            host = mapping.to_param([files.read(name) for name in mapping.hf_names])
            filler.put(mapping.param_path, host.astype(param_dtype))
            consumed.update(mapping.hf_names)
        _check_unexpected(files, consumed, config, directory)
    return filler.model()


def _zero_bias(read: Any, files: CheckpointFiles, prefix: str) -> str:
    """Some GPTQ exporters write an all-zero `bias` for every quantized module; it adds
    nothing, so it is accepted (returned as consumed) when all zero. A nonzero bias on a
    module our model has none for is an unexpected tensor."""
    name = f"{prefix}.bias"
    if name in files and not np.any(read(name)):
        return name
    return ""


def _check_unexpected(files: CheckpointFiles, consumed: set[str], config: ModelConfig,
                      directory: Path) -> None:
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(name for name in files if name not in consumed
                        and name not in allowed and not name.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointMismatchError(
            f"{directory}: {len(unexpected)} unexpected tensor(s) for a quantized "
            f"{config.model_type} model with this config, e.g. {unexpected[:5]}")
