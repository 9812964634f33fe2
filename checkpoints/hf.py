"""Hugging Face checkpoint directories <-> jaxinfer models.

`load_hf_checkpoint(directory)` reads `config.json` and the safetensors weights (single file or
sharded index) tensor by tensor: each tensor is read from its memory map, converted to our
layout and dtype, and put straight onto its devices with its target sharding before the next
one is read, so host memory peaks near one tensor (one layer's stacked experts for Mixtral),
not twice the model. `save_hf_checkpoint(model, directory)` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads.
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

from checkpoints.hf_mapping import IGNORED_SUFFIXES, TensorMapping, tensor_mappings
from checkpoints.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointFiles, write_safetensors
from jaxinfer.config import HARP_CONFIG_KEY, ModelConfig
from jaxinfer.models import Transformer, abstract_model, model_shardings
from jaxinfer.models.layers import dtype_of

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match what its config describes."""


def read_hf_config(directory: str | os.PathLike[str], **overrides: Any) -> ModelConfig:
    """Reads `config.json` (and `generation_config.json`'s EOS ids, which win) into a config.

    Raises:
        FileNotFoundError: No config.json in `directory`.
        ConfigError: The config names an unsupported model type or field value.
    """
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.exists():
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}; is this a model directory?")
    hf_config = json.loads(config_path.read_text())
    generation_path = directory / GENERATION_CONFIG_FILE
    if generation_path.exists():
        generation = json.loads(generation_path.read_text())
        if generation.get("eos_token_id") is not None:
            hf_config["eos_token_id"] = generation["eos_token_id"]
    return ModelConfig.from_hf(hf_config, **overrides)


def _harp_hint(names: list[str], config: ModelConfig) -> str:
    """Why q/k tensors may be missing or unexpected: the HARP layers of config.json's
    HARP_CONFIG_KEY (`ModelConfig.harp_alphas`) disagree with the weights."""
    if not all(name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                              "k_proj.bias")) for name in names):
        return ""
    return (f" (only q/k projections: a HARP model's top layers have none; config.json's "
            f"{HARP_CONFIG_KEY!r} must name exactly those layers, and has "
            f"{config.num_harp_layers} of {config.num_layers})")


def _check_names(files: CheckpointFiles, mappings: list[TensorMapping],
                 config: ModelConfig, directory: Path) -> None:
    expected = {name for mapping in mappings for name in mapping.hf_names}
    missing = sorted(name for name in expected if name not in files)
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(
        name for name in files
        if name not in expected and name not in allowed_extra
        and not name.endswith(IGNORED_SUFFIXES))
    if missing:
        raise CheckpointMismatchError(
            f"{directory}: {len(missing)} tensor(s) the {config.model_type} config needs are "
            f"missing, e.g. {missing[:5]}{_harp_hint(missing, config)}")
    if unexpected:
        raise CheckpointMismatchError(
            f"{directory}: {len(unexpected)} unexpected tensor(s) for a {config.model_type} "
            f"model with this config, e.g. {unexpected[:5]}{_harp_hint(unexpected, config)}")
    for mapping in mappings:
        for name, shape in zip(mapping.hf_names, mapping.hf_shapes):
            found = files.shape(name)
            if found != shape:
                raise CheckpointMismatchError(
                    f"{directory}: tensor {name!r} has shape {found} in the checkpoint but the "
                    f"config implies {shape}")


def load_hf_checkpoint(
    directory: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    layout: str | tuple = "tensor_parallel",
    **config_overrides: Any,
) -> Transformer:
    """Loads a Hugging Face Llama/Mistral/Qwen2/Mixtral directory into a jaxinfer model.

    Args:
        directory: Holds `config.json` and `model.safetensors` or
            `model.safetensors.index.json` with its shards.
        mesh: Place parameters on this mesh under `layout`; None puts them on the default
            device.
        layout: Sharding layout name or rules table (see `jaxinfer.sharding`).
        **config_overrides: ModelConfig fields to set, e.g. `param_dtype="bfloat16"`,
            `dtype="bfloat16"`.

    Returns:
        The model, its parameters in `config.param_dtype`.

    Raises:
        FileNotFoundError: config.json or the weights are missing.
        ConfigError: Unsupported model type or config field (named in the message).
        CheckpointMismatchError: Missing, unexpected or mis-shaped tensors (named, with both
            shapes).
        CheckpointFormatError: A malformed weight file or index, or one naming a file outside
            `directory` (see `checkpoints.safetensors_io`).
    """
    directory = Path(directory)
    config = read_hf_config(directory, **config_overrides)
    mappings = tensor_mappings(config)
    graphdef, abstract_state = nnx.split(abstract_model(config))
    shardings = model_shardings(config, mesh, layout) if mesh is not None else None
    variables = dict(nnx.to_flat_state(abstract_state))
    sharding_of = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    param_dtype = dtype_of(config.param_dtype)
    loaded: dict[tuple[Any, ...], jax.Array] = {}
    with CheckpointFiles(directory) as files:
        _check_names(files, mappings, config, directory)
        for mapping in mappings:
            variable = variables[mapping.param_path]
            host = mapping.to_param([files.read(name) for name in mapping.hf_names])
            host = np.ascontiguousarray(host.astype(param_dtype))
            if host.shape != variable.get_value().shape:  # the transforms are ours: a bug
                raise AssertionError(f"{mapping.param_path}: converted to {host.shape}, "
                                     f"model wants {variable.get_value().shape}")
            target = sharding_of[mapping.param_path].get_value() if shardings else None
            loaded[mapping.param_path] = jax.device_put(host, target)
            del host  # keep at most one converted tensor on the host
    if set(loaded) != set(variables):
        raise AssertionError(f"unmapped parameters: {sorted(set(variables) - set(loaded))}")
    state = nnx.from_flat_state(
        [(path, variable.replace(loaded[path])) for path, variable in variables.items()])
    return nnx.merge(graphdef, state)


def save_hf_checkpoint(
    model: Transformer,
    directory: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    tokenizer_directory: str | os.PathLike[str] | None = None,
) -> Path:
    """Writes `model` as a Hugging Face checkpoint directory.

    Args:
        model: The model to export.
        directory: Output directory (created).
        dtype: Storage dtype of the weights; defaults to the model's param dtype.
        max_shard_bytes: If set, split the weights into shards of at most about this size
            with a `model.safetensors.index.json`, as transformers does.
        tokenizer_directory: Copy the tokenizer files found there.

    Returns:
        The output directory.
    """
    config: ModelConfig = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    storage_dtype = dtype_of(dtype or config.param_dtype)
    state = dict(nnx.to_flat_state(nnx.state(model)))

    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    for mapping in tensor_mappings(config):
        host = np.asarray(jax.device_get(state[mapping.param_path].get_value()))
        for name, array in zip(mapping.hf_names, mapping.to_hf(host)):
            array = np.ascontiguousarray(array.astype(storage_dtype))
            if max_shard_bytes and shards[-1] and shard_bytes + array.nbytes > max_shard_bytes:
                shards.append({})
                shard_bytes = 0
            shards[-1][name] = array
            shard_bytes += array.nbytes

    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, shards[0])
    else:
        weight_map: dict[str, str] = {}
        total = 0
        for index, shard in enumerate(shards, start=1):
            filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(directory / filename, shard)
            weight_map.update({name: filename for name in shard})
            total += sum(array.nbytes for array in shard.values())
        index_body = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index_body, indent=2))

    hf_config = config.to_hf()
    hf_config["dtype"] = hf_config["torch_dtype"] = storage_dtype.name
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
    generation: dict[str, Any] = {"bos_token_id": config.bos_token_id,
                                  "eos_token_id": hf_config["eos_token_id"]}
    (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2))
    if tokenizer_directory is not None:
        for filename in TOKENIZER_FILES:
            source = Path(tokenizer_directory) / filename
            if source.exists():
                shutil.copy2(source, directory / filename)
    return directory
