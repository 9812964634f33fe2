"""Multi-host setup: joining JAX's multi-controller runtime (`jax.distributed`).

Past one host, jaxinfer runs as one process per host, all running the same jitted programs on
their shards of one global mesh (JAX's SPMD model). This module holds the settings every
entry point (`jaxinfer serve`, `python -m train_distill.train`) accepts for that, and the call
that joins the processes, so they are spelled the same everywhere:

    --coordinator-address HOST:PORT   process 0's address (every process passes the same)
    --num-processes N                 how many processes take part
    --process-id I                    this process's rank, 0 .. N - 1
    --distributed                     join with the platform's auto-detection (TPU pods,
                                      SLURM, Open MPI) instead of explicit settings

With none of them given, nothing is initialized and the process runs alone. The leader ->
followers step channel and the failure handling are in `jaxinfer.multihost`.
"""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins a multi-process run.

    Attributes:
        coordinator_address: "host:port" of process 0's coordination service.
        num_processes: Processes in the run.
        process_id: This process's rank.
        auto_detect: Let `jax.distributed.initialize` read the settings from the
            environment (TPU pod metadata, SLURM, Open MPI).
        local_device_ids: Devices of this host this process uses (None: all of them).
        initialization_timeout: Seconds to wait for every process to join.
        heartbeat_timeout_seconds: Seconds of silence after which a process counts as dead.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto_detect: bool = False
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout: int = 300
    heartbeat_timeout_seconds: int = 30

    def __post_init__(self) -> None:
        explicit = (self.coordinator_address, self.num_processes, self.process_id)
        given = [value is not None for value in explicit]
        if any(given) and not all(given):
            raise ValueError(
                "multi-host settings are all-or-nothing: give --coordinator-address, "
                "--num-processes and --process-id together (got coordinator_address="
                f"{self.coordinator_address!r}, num_processes={self.num_processes!r}, "
                f"process_id={self.process_id!r}), or --distributed for auto-detection")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes = {self.num_processes}: must be >= 1")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or 1):
            raise ValueError(f"process_id = {self.process_id}: must be in "
                             f"[0, num_processes = {self.num_processes})")

    @property
    def enabled(self) -> bool:
        """Whether this process takes part in a multi-process run."""
        return self.auto_detect or self.coordinator_address is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the multi-host flags (see the module docstring) to a command's parser."""
    group = parser.add_argument_group("multi-host (jax.distributed)")
    group.add_argument("--coordinator-address", default=None,
                       help="HOST:PORT of process 0's coordination service")
    group.add_argument("--num-processes", type=int, default=None,
                       help="number of processes in the run")
    group.add_argument("--process-id", type=int, default=None, help="this process's rank")
    group.add_argument("--distributed", dest="auto_detect", action="store_true",
                       help="join a multi-process run using the platform's auto-detection "
                            "(TPU pods, SLURM, Open MPI)")
    group.add_argument("--heartbeat-timeout", dest="heartbeat_timeout_seconds", type=int,
                       default=30, help="seconds after which a silent process counts as dead")


def config_from_args(args: argparse.Namespace) -> DistributedConfig:
    """The DistributedConfig of parsed `add_arguments` flags."""
    return DistributedConfig(
        coordinator_address=args.coordinator_address, num_processes=args.num_processes,
        process_id=args.process_id, auto_detect=args.auto_detect,
        heartbeat_timeout_seconds=args.heartbeat_timeout_seconds)


def initialize(config: DistributedConfig) -> bool:
    """Joins the multi-process run `config` describes; does nothing when it is disabled.

    Must run before anything touches a JAX device. On CPU the cross-process collectives go
    through gloo, which this selects. It also makes an uncaught exception end the process at
    once (`jaxinfer.multihost.exit_on_uncaught_exception`): left to itself, a failing process
    would wait in `jax.distributed.shutdown`'s barrier for the others, and they for it.

    Returns:
        Whether `jax.distributed` was initialized.
    """
    if not config.enabled:
        return False
    # Imported here, so that registering the flags (`jaxinfer --help`) does not load jax.
    import jax

    from jaxinfer import multihost

    # Only the CPU client reads this; on TPU/GPU the accelerator's own collectives serve.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.auto_detect:
        jax.distributed.initialize(initialization_timeout=config.initialization_timeout,
                                   heartbeat_timeout_seconds=config.heartbeat_timeout_seconds)
    else:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes, process_id=config.process_id,
            local_device_ids=(list(config.local_device_ids)
                              if config.local_device_ids is not None else None),
            initialization_timeout=config.initialization_timeout,
            heartbeat_timeout_seconds=config.heartbeat_timeout_seconds)
    multihost.exit_on_uncaught_exception()
    return True


def is_leader() -> bool:
    """Whether this is process 0, the one that runs front ends and the scheduler."""
    import jax

    return jax.process_index() == 0
