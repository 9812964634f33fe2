"""Logical axis names, the rules that map them to mesh axes, and mesh helpers.

Every parameter of a jaxinfer model carries logical axis names (for example a query projection
is `('embed', 'q_heads', 'head_dim')`). A *layout* is a rules table mapping each logical name
to a mesh axis (`'data'`, `'model'`, `'expert'`) or to None (replicated). Changing how a model
is split over devices means choosing another layout, never touching model code.

Layouts:
    replicated:       every parameter on every device (one chip, or pure data parallel).
    tensor_parallel:  Megatron-style serving: heads, MLP width and vocabulary split over
                      'model'; experts over 'expert' when the mesh has that axis.
    fsdp_tp:          training: the tensor-parallel split plus parameters sharded along
                      'embed' over 'data' (fully sharded data parallel).

Activations are constrained at block boundaries with `constrain(x, logical_axes)`, which reads
the layout made active by `activate(mesh, layout)`. Parameters are placed by
`parameter_shardings(...)`, which checks that every split dimension divides evenly and names
the parameter if not (for example 4 kv heads on 8 model shards).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")
MOE_MESH_AXES = ("data", "expert", "model")

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Logical names used by parameters and activations. Activation names start with "act_" so
# that a layout can split a parameter dimension without forcing the same split on activations.
_PARAMETER_AXES = ("vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "expert", "norm")
_ACTIVATION_AXES = ("batch", "length", "act_embed", "act_heads", "act_kv_heads", "act_mlp",
                    "act_vocab", "act_expert")

_TENSOR_PARALLEL: LogicalRules = (
    ("vocab", "model"),
    ("embed", None),
    ("q_heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("expert", "expert"),
    ("norm", None),
    ("batch", "data"),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "model"),
    ("act_kv_heads", "model"),
    ("act_mlp", "model"),
    ("act_vocab", "model"),
    ("act_expert", "expert"),
)


def _override(rules: LogicalRules, **changes: str | None) -> LogicalRules:
    return tuple((name, changes.get(name, target)) for name, target in rules)


LAYOUTS: dict[str, LogicalRules] = {
    "replicated": tuple((name, None) for name in _PARAMETER_AXES + _ACTIVATION_AXES),
    "tensor_parallel": _TENSOR_PARALLEL,
    # FSDP: parameters additionally split along the model width over 'data'; gathered per
    # layer by XLA when used, so each data replica holds 1/data of the weights at rest.
    "fsdp_tp": _override(_TENSOR_PARALLEL, embed="data"),
}


class ShardingError(ValueError):
    """A parameter or mesh cannot be laid out as asked."""


def get_layout(name: str) -> LogicalRules:
    """Returns the rules table of the layout called exactly `name`."""
    if name not in LAYOUTS:
        raise ShardingError(f"unknown sharding layout {name!r}; known: {sorted(LAYOUTS)}")
    return LAYOUTS[name]


def make_mesh(
    shape: Sequence[int] | dict[str, int],
    axis_names: Sequence[str] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a device mesh in Auto axis mode.

    Args:
        shape: Mesh sizes, e.g. `(2, 4)` for ('data', 'model'), or a dict name -> size.
        axis_names: Names for a tuple `shape`; defaults to ('data', 'model') for two axes and
            ('data', 'expert', 'model') for three.
        devices: Devices to use; defaults to all of `jax.devices()`.

    Returns:
        A `jax.sharding.Mesh` whose axes are all `AxisType.Auto`, so XLA propagates shardings
        from the parameters and `constrain` only has to pin block boundaries.

    Raises:
        ShardingError: The mesh needs more devices than there are.
    """
    if isinstance(shape, dict):
        axis_names = tuple(shape)
        shape = tuple(shape.values())
    shape = tuple(int(size) for size in shape)
    if axis_names is None:
        axis_names = {1: ("model",), 2: MESH_AXES, 3: MOE_MESH_AXES}.get(len(shape))
        if axis_names is None:
            raise ShardingError(f"give axis_names for a mesh of shape {shape}")
    axis_names = tuple(axis_names)
    if len(axis_names) != len(shape):
        raise ShardingError(f"mesh shape {shape} and axis names {axis_names} differ in length")
    devices = list(devices if devices is not None else jax.devices())
    needed = math.prod(shape)
    if needed > len(devices):
        raise ShardingError(
            f"mesh {dict(zip(axis_names, shape))} needs {needed} devices, "
            f"but only {len(devices)} are present")
    return jax.make_mesh(shape, axis_names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=devices[:needed])


def logical_to_spec(logical_axes: Sequence[str | None], rules: LogicalRules,
                    mesh_axis_names: Sequence[str] | None = None) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    Names missing from `rules` and mesh axes missing from the mesh map to None (replicated),
    so a layout that mentions 'expert' also works on a ('data', 'model') mesh. A mesh axis is
    used at most once per spec: a later dimension asking for an axis already taken is left
    replicated, as PartitionSpec requires.
    """
    table = dict(rules)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name in logical_axes:
        target = table.get(name) if name is not None else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        if mesh_axis_names is not None:
            targets = tuple(t for t in targets if t in mesh_axis_names)
        targets = tuple(t for t in targets if t not in used)
        used.update(targets)
        spec.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*spec)


def _axis_size(mesh: Mesh, entry: str | tuple[str, ...] | None) -> int:
    if entry is None:
        return 1
    names = (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[name] for name in names)


def parameter_shardings(abstract_state: Any, mesh: Mesh, layout: str | LogicalRules) -> Any:
    """Returns a NamedSharding for every parameter of an (abstract) NNX state.

    Args:
        abstract_state: `nnx.state(model)` or the state of `nnx.eval_shape(...)`; every
            variable carries its logical axes in the `out_sharding` metadata.
        mesh: The device mesh.
        layout: A layout name from LAYOUTS or a rules table.

    Returns:
        A pytree of the same structure as `abstract_state` (Variables holding shardings).

    Raises:
        ShardingError: A split dimension does not divide by its mesh axes; the message names
            the parameter, its shape and the mesh.
    """
    rules = get_layout(layout) if isinstance(layout, str) else layout

    def one(path: tuple[Any, ...], variable: nnx.Variable) -> nnx.Variable:
        value = variable.get_value()
        axes = variable.get_metadata().get("out_sharding") or (None,) * len(value.shape)
        if len(axes) != len(value.shape):
            raise ShardingError(
                f"parameter {_path_name(path)} has shape {tuple(value.shape)} but logical axes "
                f"{tuple(axes)}")
        spec = logical_to_spec(axes, rules, mesh.axis_names)
        for dim, (size, entry) in enumerate(zip(value.shape, spec)):
            shards = _axis_size(mesh, entry)
            if size % shards:
                raise ShardingError(
                    f"parameter {_path_name(path)} of shape {tuple(value.shape)}: dimension "
                    f"{dim} ({axes[dim]!r}, size {size}) does not divide over mesh axis "
                    f"{entry!r} of size {shards} (mesh {dict(mesh.shape)}); pick a mesh whose "
                    f"{entry!r} axis divides {size}")
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(
        one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _path_name(path: tuple[Any, ...]) -> str:
    parts = (getattr(part, "key", getattr(part, "idx", getattr(part, "name", part)))
             for part in path)
    return ".".join(str(part) for part in parts)


@contextlib.contextmanager
def activate(mesh: Mesh | None, layout: str | LogicalRules = "tensor_parallel") -> Iterator[None]:
    """Makes `mesh` the current mesh and `layout` the rules `constrain` uses.

    With `mesh=None` this does nothing, so single-device code can call it unconditionally.
    """
    if mesh is None:
        yield
        return
    rules = get_layout(layout) if isinstance(layout, str) else layout
    with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(rules):
        yield


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Pins the sharding of an activation under the active mesh and layout.

    Outside `activate(...)` (no mesh, or an empty one) it returns `x` unchanged. Dimensions
    that do not divide by their mesh axes stay replicated (a batch of 3 on 2 data shards),
    because activations, unlike parameters, may take any size.

    Args:
        x: The activation, e.g. `[B, T, D]`.
        logical_axes: One logical name (or None) per dimension of `x`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    rules = flax_spmd.get_logical_axis_rules()
    if mesh is None or mesh.empty or not rules:
        return x
    if len(logical_axes) != x.ndim:
        raise ShardingError(f"constrain: {x.ndim}-d array but axes {tuple(logical_axes)}")
    spec = logical_to_spec(logical_axes, rules, mesh.axis_names)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    entries = []
    for size, entry in zip(x.shape, spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        shards = math.prod(sizes[name] for name in names)
        entries.append(entry if size % shards == 0 else None)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*entries))


def describe(state: Any) -> dict[str, PartitionSpec]:
    """Returns {parameter path: PartitionSpec} of a placed NNX state, for tests and logs."""
    out: dict[str, PartitionSpec] = {}
    for path, variable in nnx.to_flat_state(state):
        sharding = getattr(variable.get_value(), "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        out[_path_name(path)] = spec
    return out


def active_axis(logical_name: str) -> str | None:
    """The mesh axis the active layout splits `logical_name` over, or None.

    None when no mesh and layout are active, when the layout replicates the name, or when
    its mesh axis has size 1 (nothing to split). Model code uses it to decide whether to
    run a block per shard under `jax.shard_map`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    rules = flax_spmd.get_logical_axis_rules()
    if mesh is None or mesh.empty or not rules:
        return None
    entry = logical_to_spec((logical_name,), rules, mesh.axis_names)[0]
    if entry is None or not isinstance(entry, str):
        return None  # tuple targets are not used for the names shard_map blocks split
    return entry if dict(zip(mesh.axis_names, mesh.axis_sizes))[entry] > 1 else None
