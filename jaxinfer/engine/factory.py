"""Engine assembly: `load_engine` (from a model name) and `build_engine` (from a loaded model).

    engine = load_engine("builtin:demo", max_num_seqs=32)          # vLLM's flat option names
    engine = build_engine(model, EngineConfig.from_options(...), tokenizer)

These are what `LLM`, `AsyncEngine`, `jaxinfer serve` and the benchmarks call. Both return an
`EngineClient`: a plain `Engine` for one replica, a `DataParallelEngine` for several. The
parallel layout is checked against the model's config before any weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from jax.sharding import Mesh

from checkpoints.gguf_io import shared_gguf_files
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.core import Engine
from jaxinfer.engine.data_parallel import DataParallelEngine
from jaxinfer.engine.parallel import place_on_mesh, replica_meshes
from jaxinfer.model_loading import (
    dtype_overrides,
    load_model,
    load_model_config,
    resolve_model_path,
)
from jaxinfer.models import Transformer
from jaxinfer.multihost import StepChannel
from jaxinfer.tokenizer import Tokenizer, load_tokenizer


def load_tokenizer_of(model: str | os.PathLike[str],
                      tokenizer: str | os.PathLike[str] | None) -> Tokenizer | None:
    """The tokenizer in `tokenizer` (must exist) or else in the model's directory (may not:
    `random:PRESET` serves token ids only)."""
    try:
        return load_tokenizer(resolve_model_path(tokenizer if tokenizer is not None else model))
    except FileNotFoundError:
        if tokenizer is not None:
            raise
        return None


def build_engine(model: Transformer, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, *,
                 step_channel: StepChannel | None = None) -> Engine | DataParallelEngine:
    """The engine `config`'s parallel sizes ask for, over an already loaded model.

    The model is placed on each replica's mesh (a copy per replica; no copy when it already
    sits on the first replica's mesh as that mesh's layout wants). A multi-host leader passes
    its end of the step channel: each replica's runner then sends its steps down it, tagged
    with the replica's index.

    Raises:
        ValueError: The model cannot be split as asked, or there are too few devices
            (`jaxinfer.engine.config.ParallelConfigError`); any invalid engine option.
    """
    config = config or EngineConfig()
    config.parallel.check_model(model.config)
    meshes = replica_meshes(config.parallel)
    if meshes is None:
        return Engine(model, config, tokenizer, step_channel=step_channel)
    return _replicated(config, tokenizer, [place_on_mesh(model, mesh) for mesh in meshes],
                       meshes, step_channel)


def load_engine(model: str | os.PathLike[str], *,
                tokenizer: str | os.PathLike[str] | None = None, dtype: str | None = None,
                config: EngineConfig | None = None, step_channel: StepChannel | None = None,
                **engine_options: Any) -> Engine | DataParallelEngine:
    """Loads a model (and its tokenizer, if it has one) and builds the engine its options ask
    for.

    The parallel layout is checked against the model's config before any weight is read,
    and the weights are read straight onto the replicas' devices: once, then copied to
    the other replicas in one process; once per replica in a multi-process run, where one
    program cannot copy between device sets that span several hosts.

    Args:
        model: A Hugging Face directory, `builtin:NAME`, a jaxinfer checkpoint directory
            or `random:PRESET`.
        tokenizer: Directory of the tokenizer files; None looks in the model's.
        dtype: "float32" or "bfloat16" for parameters and compute; None keeps the
            checkpoint's.
        config: The engine options as one `EngineConfig` (then `engine_options` must be
            empty).
        step_channel: A multi-host leader's end of the step channel (see `build_engine`).
        **engine_options: `EngineConfig` options by vLLM's flat names, including
            `tensor_parallel_size`, `data_parallel_size` and `expert_parallel_size`.

    Returns:
        An `Engine` when `data_parallel_size` is 1, else a `DataParallelEngine`.

    Raises:
        ValueError: An unknown option (the valid ones are listed), a bad value, or a parallel
            layout the model or the machine cannot take.
        FileNotFoundError: The model or a given tokenizer does not exist.
    """
    if config is not None and engine_options:
        raise ValueError("give config or engine options, not both")
    config = config or EngineConfig.from_options(**engine_options)
    overrides = dtype_overrides(dtype)
    with shared_gguf_files():  # a GGUF file's metadata is parsed once for all four reads
        config.parallel.check_model(load_model_config(model, **overrides))
        meshes = replica_meshes(config.parallel)
        loaded_tokenizer = load_tokenizer_of(model, tokenizer)
        if meshes is None or jax.process_count() == 1:
            network = load_model(model, mesh=None if meshes is None else meshes[0],
                                 **overrides)
            return build_engine(network, config, loaded_tokenizer, step_channel=step_channel)
        models = [load_model(model, mesh=mesh, **overrides) for mesh in meshes]
    return _replicated(config, loaded_tokenizer, models, meshes, step_channel)


def _replicated(config: EngineConfig, tokenizer: Tokenizer | None, models: list[Transformer],
                meshes: list[Mesh], step_channel: StepChannel | None
                ) -> Engine | DataParallelEngine:
    """One engine per (model, mesh); a DataParallelEngine over them if more than one."""
    replica_config = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1))
    engines = [Engine(network, replica_config, tokenizer, mesh=mesh,
                      step_channel=step_channel, channel_tag=index)
               for index, (network, mesh) in enumerate(zip(models, meshes, strict=True))]
    return engines[0] if len(engines) == 1 else DataParallelEngine(engines)
