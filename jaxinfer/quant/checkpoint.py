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

from flax import nnx
from jax.sharding import Mesh

from checkpoints import restore_model, save_model
from checkpoints.orbax_io import read_config
from jaxinfer.models import Transformer
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
