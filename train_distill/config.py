"""Training run configuration: TOML files in `train_distill/configs/`, overridable per run.

    python -m train_distill.train --config train_distill/configs/demo_teacher.toml \
        optimizer.learning_rate=1e-3 run.total_steps=200

A file has the sections [model], [data], [optimizer], [run] and optionally [mesh] and
[distill]. The [model] section names a preset (`preset = "tiny"`) and/or sets ModelConfig fields
directly; a run that starts from `[distill] student_checkpoint` takes the checkpoint's config
instead and has no [model].
Overrides are `section.key=value`, parsed as TOML values (strings may go unquoted).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxinfer.config import ModelConfig, get_preset
from jaxinfer.model_loading import load_model_config


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens are and how batches are cut."""

    tokens: str = "data/tokens"
    tokenizer: str = "data/tokenizer"
    sequence_length: int = 256
    batch_size: int = 16
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW (or OSP's Muon + AdamW) with linear warm-up and cosine decay."""

    name: str = "adamw"  # "adamw" or "osp"
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    min_learning_rate_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    gradient_clip: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Length, cadence and outputs of a run."""

    out: str = "runs/default"
    total_steps: int = 1000
    checkpoint_every: int = 200
    eval_every: int = 200
    eval_batches: int = 8
    log_every: int = 10
    seed: int = 0
    export_hf: bool = True
    progress: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """How the devices form the ('data', 'model') mesh and how parameters split over it.

    The batch is always split over 'data'. The default layout, "fsdp_tp", also splits every
    parameter (and, like it, the optimizer state) along the model width over 'data' (FSDP)
    and along heads, MLP width and vocabulary over 'model' (tensor parallel); with the
    default `model = 1` that is plain FSDP, which holds 1/data of the weights and optimizer
    state per device at the price of gathering each layer's weights when it runs.
    "replicated" is pure data parallel (every device holds everything), "tensor_parallel"
    splits over 'model' only. Every split dimension must divide by its axis size.
    """

    data: int = 0  # devices on the 'data' axis; 0: all devices not on the 'model' axis
    model: int = 1  # devices on the 'model' axis (tensor parallelism)
    layout: str = "fsdp_tp"  # a jaxinfer.sharding layout: fsdp_tp, tensor_parallel, replicated

    def __post_init__(self) -> None:
        if self.data < 0 or self.model < 1:
            raise ValueError(f"[mesh] data = {self.data}, model = {self.model}: need "
                             f"data >= 0 (0: all devices) and model >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """Knowledge distillation from a frozen teacher (empty teacher: plain training).

    `student_checkpoint` starts the student from a saved model (e.g. a `jaxinfer prune`
    output) instead of a random initialization; its config is the student's, so [model]
    is left out. With `keep_sparsity` (the default) the exact zeros of its block linear
    weights are held at zero by every optimizer step (`train_distill.sparsity`); a dense
    or structurally pruned checkpoint has no such zeros and trains unconstrained.
    """

    teacher: str = ""
    kind: str = "forward_kl"  # forward_kl, reverse_kl or jsd
    temperature: float = 1.0
    ce_weight: float = 0.5
    beta: float = 0.5
    student_checkpoint: str = ""
    keep_sparsity: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A whole training run."""

    model: ModelConfig
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for logs and the checkpoint directory."""
        return {"model": self.model.to_dict(), "data": dataclasses.asdict(self.data),
                "optimizer": dataclasses.asdict(self.optimizer),
                "run": dataclasses.asdict(self.run), "mesh": dataclasses.asdict(self.mesh),
                "distill": dataclasses.asdict(self.distill)}


_SECTIONS = {"data": DataConfig, "optimizer": OptimizerConfig, "run": RunConfig,
             "mesh": MeshConfig, "distill": DistillConfig}


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text  # an unquoted string


def _coerce(section: str, cls: type, values: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    known = {field.name for field in dataclasses.fields(cls)}
    for key, value in values.items():
        if section == "run" and key == "data_parallel":
            raise ValueError("[run] data_parallel moved to [mesh] data (beside mesh.model and "
                             "mesh.layout)")
        if key not in known:
            raise ValueError(f"[{section}] has no field {key!r}; known: {sorted(known)}")
        if hints[key] is float and isinstance(value, int) and not isinstance(value, bool):
            values[key] = float(value)
    return values


def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Reads a TOML run config and applies `section.key=value` overrides.

    Raises:
        ValueError: An unknown section or field, or a malformed override (named).
    """
    raw: dict[str, Any] = tomllib.loads(Path(path).read_text()) if path else {}
    for override in overrides:
        key, separator, value = override.partition("=")
        section, dot, field = key.partition(".")
        if not separator or not dot:
            raise ValueError(f"override {override!r}: expected section.key=value")
        raw.setdefault(section, {})[field] = _parse_value(value)
    unknown = sorted(set(raw) - set(_SECTIONS) - {"model"})
    if unknown:
        raise ValueError(f"unknown config section(s) {unknown}; known: model, "
                         f"{', '.join(_SECTIONS)}")
    model_fields = dict(raw.get("model", {}))
    student_checkpoint = raw.get("distill", {}).get("student_checkpoint", "")
    preset = model_fields.pop("preset", None)
    if student_checkpoint:
        if model_fields or preset is not None:
            raise ValueError("[distill] student_checkpoint sets the student's config; leave "
                             "[model] out")
        model = load_model_config(student_checkpoint)
    elif "rope_scaling" in model_fields:
        raise ValueError("[model] rope_scaling: set it through a preset")
    elif preset is not None:
        model = get_preset(preset).replace(**model_fields)
    elif model_fields:
        model = ModelConfig(**model_fields)
    else:
        raise ValueError("[model] needs a preset or the ModelConfig fields (or [distill] "
                         "student_checkpoint)")
    sections = {name: cls(**_coerce(name, cls, dict(raw.get(name, {}))))
                for name, cls in _SECTIONS.items()}
    return TrainConfig(model=model, **sections)
