"""Quantized checkpoints: an orbax model directory plus the quantization config that shaped it.

A quantized directory is what `checkpoints.save_model` writes (`jaxinfer_config.json` and the
orbax `state/`, here holding int8 / packed-int4 values, scales and zero points) plus
`jaxinfer_quantization.json` (the `QuantizationConfig`) and the source model's tokenizer
files. The quantization config alone fixes which projections are `QuantizedLinear` layers
and in which format, so restoring builds that structure abstractly (no weights computed),
then lets orbax fill it. `jaxinfer.model_loading.load_model` recognises the directory, so
`LLM(model=DIR)`, `jaxinfer generate` and `jaxinfer serve` load it as any other model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from checkpoints import restore_model, save_model
from checkpoints.orbax_io import read_config
from jaxinfer.models import Transformer, model_shardings
from jaxinfer.quant.config import QuantizationConfig
from jaxinfer.quant.linear import quantize_model

QUANTIZATION_FILE = "jaxinfer_quantization.json"
# Copied from the source model so the quantized directory serves text on its own.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


def is_quantized_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` holds a quantized checkpoint written by `save_quantized_model`."""
    return (Path(directory) / QUANTIZATION_FILE).is_file()


def save_quantized_model(model: Transformer, config: QuantizationConfig,
                         directory: str | os.PathLike[str], *,
                         tokenizer_directory: str | os.PathLike[str] | None = None) -> Path:
    """Writes a quantized model, its quantization config and tokenizer files.

    Args:
        model: The output of `quantize_model` (or of GPTQ / SmoothQuant) for `config`.
        config: The rules that produced it; saved as JSON.
        directory: Output directory (created).
        tokenizer_directory: Where to copy tokenizer files from (those of `TOKENIZER_FILES`
            that exist), e.g. the source model's directory; None copies none.

    Returns:
        The absolute output directory.
    """
    directory = save_model(model, directory)
    (directory / QUANTIZATION_FILE).write_text(json.dumps(config.to_dict(), indent=2))
    if tokenizer_directory is not None:
        for name in TOKENIZER_FILES:
            source = Path(tokenizer_directory) / name
            if source.is_file():
                shutil.copyfile(source, directory / name)
    return directory


def read_quantization_config(directory: str | os.PathLike[str]) -> QuantizationConfig:
    """The `QuantizationConfig` saved in a quantized checkpoint.

    Raises:
        FileNotFoundError: The directory has no quantization config.
    """
    path = Path(directory) / QUANTIZATION_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {QUANTIZATION_FILE}; not a quantized "
                                "jaxinfer checkpoint")
    return QuantizationConfig.from_dict(json.loads(path.read_text()))


def abstract_quantized_model(directory: str | os.PathLike[str]) -> Transformer:
    """The quantized module tree a checkpoint holds, with shapes and dtypes only."""
    model_config = read_config(directory)
    quantization = read_quantization_config(directory)
    # Round-to-nearest builds the same structure every method produces (the method only
    # changes the values), and under eval_shape it computes nothing.
    return nnx.eval_shape(lambda: quantize_model(Transformer(model_config, rngs=nnx.Rngs(0)),
                                                 quantization))


def restore_quantized_model(directory: str | os.PathLike[str], *, mesh: Mesh | None = None,
                            layout: str = "tensor_parallel") -> Transformer:
    """Restores a checkpoint written by `save_quantized_model`, onto `mesh` under `layout`
    (each quantized layer split like the float weight it replaced) or the default device."""
    return restore_model(directory, mesh=mesh, layout=layout,
                         abstract=abstract_quantized_model(directory))


class ModelFiller:
    """Fills an abstract model's arrays one at a time from host arrays, each put straight onto
    its devices, so a checkpoint converted tensor by tensor (GGUF blocks, GPTQ / AWQ packs)
    never holds a second whole copy of the model. Used by the loaders of foreign formats
    (`jaxinfer.quant.gguf`, `jaxinfer.quant.pre_quantized_loading`).

    Args:
        abstract: The model's structure with abstract arrays (`nnx.eval_shape`), quantized
            sites already `QuantizedLinear`.
        mesh: Place each array on this mesh under `layout`; None: the default device.
        layout: Sharding layout name or rules table.
    """

    def __init__(self, abstract: Transformer, mesh: Mesh | None,
                 layout: str | tuple = "tensor_parallel") -> None:
        self._graphdef, state = nnx.split(abstract)
        self._variables = dict(nnx.to_flat_state(state))
        self._shardings = ({} if mesh is None else dict(nnx.to_flat_state(
            model_shardings(abstract.config, mesh, layout, model=abstract))))
        self._loaded: dict[tuple[Any, ...], jax.Array] = {}

    def __contains__(self, path: tuple[Any, ...]) -> bool:
        """Whether `path` (a flat state key) is one of the model's arrays."""
        return path in self._variables

    def put(self, path: tuple[Any, ...], host: np.ndarray) -> None:
        """Places one array; its shape and dtype must be the model's (a mismatch is a bug in
        the converter, not in the file, which the caller checked)."""
        wanted = self._variables[path].get_value()
        if host.shape != wanted.shape or host.dtype != wanted.dtype:
            raise AssertionError(f"{path}: converted to {host.dtype} {host.shape}, model "
                                 f"wants {wanted.dtype} {wanted.shape}")
        target = self._shardings[path].get_value() if self._shardings else None
        self._loaded[path] = jax.device_put(np.ascontiguousarray(host), target)

    def model(self) -> Transformer:
        """The filled model.

        Raises:
            AssertionError: Some array was never put.
        """
        missing = sorted(set(self._variables) - set(self._loaded))
        if missing:
            raise AssertionError(f"arrays never filled: {missing}")
        state = nnx.from_flat_state([(path, variable.replace(self._loaded[path]))
                                     for path, variable in self._variables.items()])
        return nnx.merge(self._graphdef, state)
