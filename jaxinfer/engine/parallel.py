"""How the engine spreads over devices: tensor, expert and data parallel sizes, and meshes.

vLLM's three knobs, with the same names (`tensor_parallel_size`, `data_parallel_size`,
`expert_parallel_size`) on `LLM(...)`, `EngineConfig` and `jaxinfer serve`:

- Tensor parallel (TP = N): one model split over a mesh axis 'model' of N devices: attention
  heads, MLP width and vocabulary (the `tensor_parallel` layout of `jaxinfer.sharding`); the
  KV page pool is split on KV heads, so each device keeps the pages of its own heads and
  attention runs per device without communication; logits are gathered once per step.
- Expert parallel (EP = E, Mixtral): the experts split over a mesh axis 'expert' of E devices;
  each device runs its experts on the tokens routed to them, and one all-reduce adds the
  results (`jaxinfer.models.moe.MoEBlock`). The mesh of a replica is then ('expert', 'model')
  with E x N devices, attention split over 'model' and replicated over 'expert'.
- Data parallel (DP = R): R independent replicas, each with its own TP x EP sub-mesh, page
  pool, scheduler and jitted step (`jaxinfer.engine.data_parallel`). Requests go to the
  least-loaded replica. We chose replicas over one batch sharded over a 'data' axis because a
  ragged continuous batch does not split evenly: a sharded batch would pad every shard to the
  longest one and make all replicas step in lockstep, and prefix-cache hits, preemption and
  page pressure are per replica anyway. Replicas share nothing, so each steps at its own pace
  (vLLM's and JetStream's data parallelism work the same way).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxinfer.config import ModelConfig
from jaxinfer.models import Transformer
from jaxinfer.sharding import make_mesh, parameter_shardings


class ParallelConfigError(ValueError):
    """A parallel layout the model or the machine cannot take; the message says why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor, data and expert parallel sizes.

    Attributes:
        tensor_parallel_size: Devices one model's heads and MLP are split over.
        data_parallel_size: Independent engine replicas.
        expert_parallel_size: Devices a MoE model's experts are split over (within a replica).
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"{name} = {value!r}: must be an integer >= 1")

    @property
    def devices_per_replica(self) -> int:
        """Devices one replica's mesh holds: TP x EP."""
        return self.tensor_parallel_size * self.expert_parallel_size

    @property
    def world_size(self) -> int:
        """Devices the whole engine uses: TP x EP x DP."""
        return self.devices_per_replica * self.data_parallel_size

    @property
    def is_single_device(self) -> bool:
        return self.world_size == 1

    def check_model(self, config: ModelConfig) -> None:
        """Fails with a message when the model cannot be split as asked.

        Raises:
            ParallelConfigError: Heads, KV heads, MLP width or vocabulary not divisible by
                the TP size; EP on a dense model or experts not divisible by the EP size.
        """
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        for what, size in (("attention heads (num_heads)", config.num_heads),
                           ("KV heads (num_kv_heads)", config.num_kv_heads),
                           ("MLP width (intermediate_size)", config.intermediate_size),
                           ("vocabulary (vocab_size)", config.vocab_size)):
            if size % tp:
                raise ParallelConfigError(
                    f"tensor_parallel_size = {tp} does not divide the model's {size} {what}; "
                    f"use a TP size that divides {math.gcd(config.num_heads, config.num_kv_heads)}"
                    " (the KV heads bound it: each device keeps whole KV heads)")
        if ep > 1:
            if not config.is_moe:
                raise ParallelConfigError(
                    f"expert_parallel_size = {ep}, but the model has no experts (dense)")
            if config.num_experts % ep:
                raise ParallelConfigError(
                    f"expert_parallel_size = {ep} does not divide the model's "
                    f"{config.num_experts} experts")

    def replica_meshes(self, devices: Sequence[jax.Device] | None = None) -> list[Mesh] | None:
        """One mesh per data-parallel replica; None on one device.

        A replica's mesh is ('model',) of TP devices, or ('expert', 'model') of EP x TP
        devices when EP > 1. In one process, replica r takes devices r x TP x EP onwards. In a
        multi-process run every replica takes an equal share of every process's devices,
        because process 0 schedules every replica and must take part in (and read the
        results of) each replica's steps.

        Raises:
            ParallelConfigError: More devices are asked for than there are, or (several
                processes) a replica's devices do not split evenly over the processes.
        """
        if self.is_single_device:
            return None
        devices = list(jax.devices() if devices is None else devices)
        if self.world_size > len(devices):
            raise ParallelConfigError(
                f"tensor_parallel_size x expert_parallel_size x data_parallel_size = "
                f"{self.tensor_parallel_size} x {self.expert_parallel_size} x "
                f"{self.data_parallel_size} = {self.world_size} devices, but only "
                f"{len(devices)} {jax.default_backend()} devices are present")
        shape = ({"expert": self.expert_parallel_size, "model": self.tensor_parallel_size}
                 if self.expert_parallel_size > 1 else {"model": self.tensor_parallel_size})
        per_replica = self.devices_per_replica
        by_process: dict[int, list[jax.Device]] = {}
        for device in devices:
            by_process.setdefault(device.process_index, []).append(device)
        processes = len(by_process)
        if per_replica % processes:
            raise ParallelConfigError(
                f"a replica of tensor_parallel_size x expert_parallel_size = {per_replica} "
                f"devices cannot span the {processes} processes of this run evenly; use a "
                f"multiple of {processes}")
        share = per_replica // processes
        fewest = min(len(local) for local in by_process.values())
        if share * self.data_parallel_size > fewest:
            raise ParallelConfigError(
                f"{self.data_parallel_size} replicas x {share} devices per process exceed the "
                f"{fewest} devices of a process")
        groups = [sorted(local, key=lambda device: device.id)
                  for _, local in sorted(by_process.items())]
        return [make_mesh(shape, devices=[device for local in groups
                                          for device in local[index * share:
                                                              (index + 1) * share]])
                for index in range(self.data_parallel_size)]


def place_on_mesh(model: Transformer, mesh: Mesh, layout: str = "tensor_parallel"
                  ) -> Transformer:
    """The model with its parameters placed on `mesh` under `layout` (a copy unless they
    are there already).

    Raises:
        ShardingError: A parameter cannot be split as the layout asks (named in the message).
    """
    graphdef, state = nnx.split(model)
    shardings = parameter_shardings(state, mesh, layout)
    return nnx.merge(graphdef, jax.device_put(state, shardings))
