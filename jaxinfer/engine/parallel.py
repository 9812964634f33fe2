"""How the engine spreads over devices: tensor, expert and data parallel sizes, and meshes.

vLLM's three knobs, with the same names (`tensor_parallel_size`, `data_parallel_size`,
`expert_parallel_size`) on `LLM(...)`, `EngineConfig` and `jaxinfer serve`:

- Tensor parallel (TP): one model split over a mesh axis 'model' of TP devices: attention
  heads, MLP width and vocabulary (the `tensor_parallel` layout of `jaxinfer.sharding`); the
  KV page pool is split on KV heads, so each device keeps the pages of its own heads and
  attention runs per device without communication; logits are gathered once per step.
- Expert parallel (EP, Mixtral): the experts split over a mesh axis 'expert' of EP devices;
  each device runs its experts on the tokens routed to them, and one all-reduce adds the
  results (`jaxinfer.models.moe.MoEBlock`). The mesh of a replica is then ('expert', 'model')
  with EP x TP devices, attention split over 'model' and replicated over 'expert'.
- Data parallel (DP): DP independent replicas, each with its own TP x EP sub-mesh, page
  pool, scheduler and jitted step (`jaxinfer.engine.data_parallel`). Requests go to the
  least-loaded replica. We chose replicas over one batch sharded over a 'data' axis because a
  ragged continuous batch does not split evenly: a sharded batch would pad every shard to the
  longest one and make all replicas step in lockstep, and prefix-cache hits, preemption and
  page pressure are per replica anyway. Replicas share nothing, so each steps at its own pace
  (vLLM's and JetStream's data parallelism work the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxinfer.engine.config import ParallelConfig, ParallelConfigError
from jaxinfer.models import Transformer
from jaxinfer.sharding import make_mesh, parameter_shardings

__all__ = ["ParallelConfig", "ParallelConfigError", "place_on_mesh", "replica_meshes"]


def replica_meshes(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None
                   ) -> list[Mesh] | None:
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
    if parallel.is_single_device:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if parallel.world_size > len(devices):
        raise ParallelConfigError(
            f"tensor_parallel_size x expert_parallel_size x data_parallel_size = "
            f"{parallel.tensor_parallel_size} x {parallel.expert_parallel_size} x "
            f"{parallel.data_parallel_size} = {parallel.world_size} devices, but only "
            f"{len(devices)} {jax.default_backend()} devices are present")
    shape = ({"expert": parallel.expert_parallel_size, "model": parallel.tensor_parallel_size}
             if parallel.expert_parallel_size > 1 else {"model": parallel.tensor_parallel_size})
    per_replica = parallel.devices_per_replica
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
    if share * parallel.data_parallel_size > fewest:
        raise ParallelConfigError(
            f"{parallel.data_parallel_size} replicas x {share} devices per process exceed the "
            f"{fewest} devices of a process")
    groups = [sorted(local, key=lambda device: device.id)
              for _, local in sorted(by_process.items())]
    return [make_mesh(shape, devices=[device for local in groups
                                      for device in local[index * share:
                                                          (index + 1) * share]])
            for index in range(parallel.data_parallel_size)]


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
