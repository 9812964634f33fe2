"""Structured pruning: a smaller dense model with fewer KV groups, MLP channels and layers.

Minitron-style (METHODS.md §7): score every KV group (a key/value head and the G query heads
sharing it, removed together so grouped-query attention stays valid), every MLP intermediate
channel and every decoder layer on calibration text (`jaxinfer.prune.importance`), then slice
out the lowest-scoring ones. The result is a plain dense `Transformer` with a smaller
`ModelConfig` (fewer `num_kv_heads`/`num_heads`, a smaller `intermediate_size`, fewer
`num_layers`), so every engine path, the checkpoint exporters and HF transformers serve it
unchanged, faster and in less memory.

Our config holds one head count and one MLP width for all layers, so every layer loses the
same number of KV groups and channels, each layer choosing which by its own scores. What
removing a structure does to the function:

- a KV group: its query heads stop contributing, exactly as if their o_proj rows were zero
  (softmax runs per head, so zeroing q/k/v would not be the same);
- an MLP channel: exactly as if its down_proj row were zero;
- a layer: the residual stream skips the block.

RMSNorm gains, embeddings and the LM head are untouched. Left out: HARP (attention pruning
with rescaling of the top layers) and recovery distillation from the unpruned model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models import Transformer
from jaxinfer.models.transformer import abstract_model
from jaxinfer.prune.importance import (
    DEFAULT_BATCH_SIZE,
    StructureScores,
    check_prunable,
    structure_importance,
)


@dataclasses.dataclass(frozen=True)
class StructuredPruning:
    """How much of each structure to remove.

    Attributes:
        heads: Fraction of KV groups to remove in every layer (rounded to a whole number of
            groups, at least one kept).
        mlp: Fraction of MLP intermediate channels to remove in every layer (rounded, at
            least one kept).
        layers: Number of whole decoder layers to remove (at least one kept).
        mlp_multiple: Keep a multiple of this many channels, rounding the kept width up
            (fewer removed than `mlp` asks), so the pruned width still fills the matmul
            tiles (128 on a TPU's MXU) and splits evenly under tensor parallelism.
    """

    heads: float = 0.0
    mlp: float = 0.0
    layers: int = 0
    mlp_multiple: int = 1

    def __post_init__(self) -> None:
        for name in ("heads", "mlp"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"structured pruning {name} = {value}: a fraction in [0, 1)")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 0:
            raise ValueError(f"structured pruning layers = {self.layers!r}: a count >= 0")
        if (isinstance(self.mlp_multiple, bool) or not isinstance(self.mlp_multiple, int)
                or self.mlp_multiple < 1):
            raise ValueError(f"structured pruning mlp_multiple = {self.mlp_multiple!r}: a "
                             "count >= 1")

    @classmethod
    def parse(cls, text: str) -> StructuredPruning:
        """Reads the CLI spelling `heads=0.25,mlp=0.3,layers=2` (any subset, any order;
        `mlp_multiple=128` too).

        Raises:
            ValueError: An unknown or repeated key, a missing `=`, or a bad value.
        """
        fields: dict[str, float | int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, equals, value = item.partition("=")
            key = key.strip()
            if not equals:
                raise ValueError(f"structured pruning {item!r}: expected key=value")
            if key not in ("heads", "mlp", "layers", "mlp_multiple"):
                raise ValueError(f"structured pruning key {key!r}: expected heads, mlp, "
                                 "layers or mlp_multiple")
            if key in fields:
                raise ValueError(f"structured pruning key {key!r} given twice")
            try:
                whole = key in ("layers", "mlp_multiple")
                fields[key] = int(value) if whole else float(value)
            except ValueError:
                raise ValueError(f"structured pruning {key} = {value.strip()!r}: not a "
                                 f"{'whole number' if whole else 'number'}") from None
        return cls(**fields)

    def removed_counts(self, config: ModelConfig) -> tuple[int, int, int]:
        """KV groups per layer, channels per layer and layers that `config` loses.

        Raises:
            ValueError: Nothing of a structure would be left.
        """
        groups = round(self.heads * config.num_kv_heads)
        width = config.intermediate_size
        kept = width - round(self.mlp * width)
        kept = min(width, -(-kept // self.mlp_multiple) * self.mlp_multiple)  # rounded up
        channels = width - kept
        if groups >= config.num_kv_heads:
            raise ValueError(f"heads = {self.heads} removes all {config.num_kv_heads} KV groups")
        if channels >= config.intermediate_size:
            raise ValueError(f"mlp = {self.mlp} removes all {config.intermediate_size} "
                             "channels")
        if self.layers >= config.num_layers:
            raise ValueError(f"layers = {self.layers} removes all {config.num_layers} layers")
        return groups, channels, self.layers


class PruningPlan(NamedTuple):
    """What a pruned model keeps of the original, indices in ascending order.

    Attributes:
        kv_groups: Per original layer, the KV heads kept (the same count in every layer).
        channels: Per original layer, the MLP channels kept (the same count in every layer).
        layers: The original layers kept, in order (the pruned model's layer i is
            `layers[i]`).
    """

    kv_groups: tuple[tuple[int, ...], ...]
    channels: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]


def _keep_highest(scores: np.ndarray, keep: int) -> tuple[int, ...]:
    """Indices of the `keep` highest of `[X]` scores, ascending (stable on ties)."""
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    return tuple(sorted(int(index) for index in order[:keep]))


def plan_pruning(config: ModelConfig, scores: StructureScores,
                 spec: StructuredPruning) -> PruningPlan:
    """Keeps the highest-scoring structures, as many as `spec` leaves.

    Layers are chosen by their own scores over the whole model; KV groups and channels by
    each layer's own scores, the same number in every layer.
    """
    groups, channels, layers = spec.removed_counts(config)
    return PruningPlan(
        kv_groups=tuple(_keep_highest(row, config.num_kv_heads - groups)
                        for row in scores.kv_groups),
        channels=tuple(_keep_highest(row, config.intermediate_size - channels)
                       for row in scores.channels),
        layers=_keep_highest(scores.layers, config.num_layers - layers))


def pruned_config(config: ModelConfig, plan: PruningPlan) -> ModelConfig:
    """The config of the model `plan` leaves (head_dim and every other field unchanged).

    Raises:
        ValueError: The plan keeps different numbers of groups or channels in different
            layers, or names a structure the config does not have.
    """
    group_counts = {len(kept) for kept in plan.kv_groups}
    channel_counts = {len(kept) for kept in plan.channels}
    if len(plan.kv_groups) != config.num_layers or len(plan.channels) != config.num_layers:
        raise ValueError(f"the plan covers {len(plan.kv_groups)} / {len(plan.channels)} "
                         f"layers; the model has {config.num_layers}")
    if len(group_counts) != 1 or len(channel_counts) != 1:
        raise ValueError("every layer must keep the same number of KV groups and channels "
                         f"(kept: {sorted(group_counts)} groups, {sorted(channel_counts)} "
                         "channels)")
    for name, kept, size in (
            ("KV group", [i for row in plan.kv_groups for i in row], config.num_kv_heads),
            ("channel", [i for row in plan.channels for i in row], config.intermediate_size),
            ("layer", plan.layers, config.num_layers)):
        if not kept or min(kept) < 0 or max(kept) >= size:
            raise ValueError(f"the plan keeps {name}s outside 0..{size - 1} or none")
    num_kv_heads = group_counts.pop()
    return config.replace(num_kv_heads=num_kv_heads,
                          num_heads=num_kv_heads * config.group_size,
                          intermediate_size=channel_counts.pop(),
                          num_layers=len(plan.layers))


def _query_heads(kv_groups: Sequence[int], group_size: int) -> np.ndarray:
    """`[K' * G]` query heads of the kept groups (head n = k * G + g, as attention groups)."""
    return (np.asarray(kv_groups)[:, None] * group_size
            + np.arange(group_size)[None, :]).reshape(-1)


def _slicer(name: str, kv_groups: Sequence[int], channels: Sequence[int], group_size: int
            ) -> Callable[[jax.Array], jax.Array] | None:
    """How the block parameter `name` (its path inside the block) is sliced, or None when
    it is kept whole (the norms)."""
    queries, kv = _query_heads(kv_groups, group_size), np.asarray(kv_groups)
    channels = np.asarray(channels)
    axes = {
        ("attention", "q_proj"): (queries, 1),  # [D, N, H]
        ("attention", "k_proj"): (kv, 1),  # [D, K, H]
        ("attention", "v_proj"): (kv, 1),  # [D, K, H]
        ("attention", "o_proj"): (queries, 0),  # [N, H, D]
        ("attention", "q_bias"): (queries, 0),  # [N, H]
        ("attention", "k_bias"): (kv, 0),  # [K, H]
        ("attention", "v_bias"): (kv, 0),  # [K, H]
        ("mlp", "gate_proj"): (channels, 1),  # [D, F]
        ("mlp", "up_proj"): (channels, 1),  # [D, F]
        ("mlp", "down_proj"): (channels, 0),  # [F, D]
    }.get(tuple(name))
    if axes is None:
        return None
    indices, axis = axes
    return lambda array: jnp.take(array, jnp.asarray(indices), axis=axis)


def apply_plan(model: Transformer, plan: PruningPlan) -> Transformer:
    """The smaller dense model that keeps what `plan` names (see the module docstring).

    The model is not changed. The pruned model's arrays are on the default device; engines
    and `create_model`-style placement shard them afresh.

    Raises:
        ValueError: The model cannot be pruned (`check_prunable`) or the plan does not fit it.
    """
    check_prunable(model)
    config = pruned_config(model.config, plan)
    graphdef, abstract_state = nnx.split(abstract_model(config))
    source = dict(nnx.to_flat_state(nnx.state(model)))
    group_size = model.config.group_size
    pruned = []
    for path, variable in nnx.to_flat_state(abstract_state):
        if path[0] == "layers":
            old_layer = plan.layers[path[1]]
            array = source[("layers", old_layer, *path[2:])].get_value()
            slicer = _slicer(path[2:], plan.kv_groups[old_layer], plan.channels[old_layer],
                             group_size)
            if slicer is not None:
                array = slicer(array)
        else:
            array = source[path].get_value()
        wanted = variable.get_value().shape
        if array.shape != wanted:  # the slicing table above is ours: a bug
            raise AssertionError(f"{path}: sliced to {array.shape}, the pruned model wants "
                                 f"{wanted}")
        pruned.append((path, variable.replace(jax.device_put(array, jax.devices()[0]))))
    return nnx.merge(graphdef, nnx.from_flat_state(pruned))


def structured_prune(model: Transformer, spec: StructuredPruning | str, windows: np.ndarray,
                     importance: str = "activation", *,
                     batch_size: int = DEFAULT_BATCH_SIZE) -> Transformer:
    """Scores the model's structures on calibration windows and slices out the least
    important ones (`jaxinfer prune --structured heads=...,mlp=...,layers=N`).

    Args:
        model: A dense float model with unstacked layers.
        spec: What to remove, or its CLI spelling (`StructuredPruning.parse`).
        windows: `[B, T]` calibration token windows
            (`jaxinfer.quant.calibration.calibration_windows`).
        importance: "activation" (Minitron's activation norms and block influence) or
            "taylor" (|w · ∂L/∂w| per structure).
        batch_size: Calibration windows per forward (and backward) pass.

    Returns:
        A new, smaller dense model; `model` is unchanged.

    Raises:
        ValueError: A bad spec, an estimator not known, or a model that cannot be pruned.
    """
    if isinstance(spec, str):
        spec = StructuredPruning.parse(spec)
    spec.removed_counts(model.config)  # fail on a bad spec before the calibration pass
    scores = structure_importance(model, windows, importance, batch_size=batch_size)
    return apply_plan(model, plan_pruning(model.config, scores, spec))
