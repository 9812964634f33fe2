"""Saving and restoring jaxinfer models as orbax checkpoints of their NNX state.

A saved directory holds `jaxinfer_config.json` (the ModelConfig) and `state/` (orbax). Restore
builds the abstract model from the config, attaches the target sharding of every parameter
(for any mesh and layout, not only the one it was saved from) and lets orbax read each shard
straight onto its device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from jaxinfer.config import ModelConfig
from jaxinfer.models import Transformer, abstract_model, model_shardings

CONFIG_FILE = "jaxinfer_config.json"
STATE_DIRECTORY = "state"


def save_model(model: Transformer, directory: str | os.PathLike[str]) -> Path:
    """Writes the model's config and parameters under `directory` (created; must be new)."""
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / STATE_DIRECTORY, nnx.state(model))
        checkpointer.wait_until_finished()
    return directory


def read_config(directory: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig saved beside an orbax model checkpoint."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}; not a jaxinfer checkpoint")
    return ModelConfig.from_dict(json.loads(path.read_text()))


def restore_model(
    directory: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    layout: str | tuple = "tensor_parallel",
    abstract: Transformer | None = None,
) -> Transformer:
    """Restores a model saved by `save_model`, onto `mesh` under `layout` if given.

    Args:
        directory: What `save_model` wrote.
        mesh: Target mesh; any shape whose axes divide the parameters. None restores onto
            the default device.
        layout: Sharding layout for `mesh`.
        abstract: The abstract module tree to restore into, when the saved model is not the
            config's plain float model (a quantized one, whose projections are modules of
            integer arrays carrying their own logical axes).
    """
    directory = Path(directory).absolute()
    config = read_config(directory)
    graphdef, abstract_state = nnx.split(abstract or abstract_model(config))
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract_state)
    else:
        shardings = model_shardings(config, mesh, layout, model=abstract)
    target = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_state, shardings)
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(directory / STATE_DIRECTORY, target)
    return nnx.merge(graphdef, state)
