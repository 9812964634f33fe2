"""Checkpoint I/O: Hugging Face safetensors directories and orbax checkpoints of NNX state.

May import `jaxinfer.config` and `jaxinfer.models` only (see ARCHITECTURE.md).
"""

from checkpoints.hf import (
    CheckpointMismatchError,
    load_hf_checkpoint,
    read_hf_config,
    save_hf_checkpoint,
)
from checkpoints.orbax_io import restore_model, save_model
from checkpoints.safetensors_io import CheckpointFormatError

__all__ = [
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "load_hf_checkpoint",
    "read_hf_config",
    "restore_model",
    "save_hf_checkpoint",
    "save_model",
]
