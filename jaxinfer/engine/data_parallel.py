"""Data parallelism: independent engine replicas behind one Engine-shaped front.

Each replica is a whole `Engine` (scheduler, page pool, jitted step) on its own TP x EP
sub-mesh (`jaxinfer.engine.parallel` says why replicas rather than one sharded batch). A new
request goes to the replica with the fewest unfinished requests (ties: fewest waiting, then
the lowest index), and stays there: its pages live in that replica's pool. `step()` steps
every replica that has work, each in its own thread, so their device steps overlap (JAX
releases the GIL while a step runs), and returns all their outputs; in a multi-process run
the replicas step one after another instead, in the order process 0 sends their steps to
the other processes.

`load_engine` (from a model name) and `build_engine` (from a loaded model) are what `LLM`,
`AsyncEngine`, `jaxinfer serve` and the benchmarks call: they return a plain `Engine` for one
replica and a `DataParallelEngine` for several.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any

import jax
from jax.sharding import Mesh

from jaxinfer.engine.core import (
    Engine,
    EngineConfig,
    EngineStats,
    Prompt,
    engine_config,
    load_tokenizer_of,
)
from jaxinfer.engine.device.runner import ModelRunner
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.parallel import place_on_mesh
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.model_loading import load_model, load_model_config
from jaxinfer.models import Transformer
from jaxinfer.tokenizer import Tokenizer


class DataParallelEngine:
    """`data_parallel_size` engine replicas with `Engine`'s request interface.

    Args:
        replicas: The replica engines (same model, same options, each on its own devices).
    """

    def __init__(self, replicas: list[Engine]) -> None:
        if not replicas:
            raise ValueError("a DataParallelEngine needs at least one replica")
        self.replicas = replicas
        self.config = dataclasses.replace(replicas[0].config,
                                          data_parallel_size=len(replicas))
        self.model_config = replicas[0].model_config
        self.tokenizer = replicas[0].tokenizer
        self.speculative = replicas[0].speculative
        self._owner: dict[str, Engine] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(replicas), thread_name_prefix="jaxinfer-replica")

    # ------------------------------------------------------------------ Engine's interface

    def add_request(self, request_id: str, prompt: Prompt,
                    sampling_params: SamplingParams | None = None, **options: Any) -> None:
        """Queues a request on the least-loaded replica (see `Engine.add_request`).

        Raises:
            ValueError: As `Engine.add_request`, including an id in use on any replica.
        """
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = min(self.replicas, key=lambda engine: (
            engine.num_unfinished_requests, engine.stats().num_waiting,
            self.replicas.index(engine)))
        replica.add_request(request_id, prompt, sampling_params, **options)
        self._owner[request_id] = replica

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Aborts a request on its replica (see `Engine.abort_request`)."""
        replica = self._owner.pop(request_id, None)
        return None if replica is None else replica.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    @property
    def num_unfinished_requests(self) -> int:
        return sum(replica.num_unfinished_requests for replica in self.replicas)

    def step(self) -> list[RequestOutput]:
        """Steps every replica with work, concurrently; returns all their outputs."""
        busy = [replica for replica in self.replicas if replica.has_unfinished_requests()]
        if len(busy) <= 1 or jax.process_count() > 1:
            # Several processes must launch the replicas' programs in one agreed order (the
            # order the leader sends them to the followers), so they run one after another.
            outputs = [output for replica in busy for output in replica.step()]
        else:
            futures = [self._pool.submit(replica.step) for replica in busy]
            outputs = [output for future in futures for output in future.result()]
        for output in outputs:
            if output.finished:
                self._owner.pop(output.request_id, None)
        return outputs

    def warm_up(self) -> float:
        """Compiles every replica's steps, concurrently; returns the wall-clock seconds."""
        if jax.process_count() > 1:
            return sum(replica.warm_up() for replica in self.replicas)
        futures = [self._pool.submit(replica.warm_up) for replica in self.replicas]
        return max(future.result() for future in futures)

    @property
    def compilations(self) -> int:
        return sum(replica.compilations for replica in self.replicas)

    @property
    def runners(self) -> list[ModelRunner]:
        """The replicas' runners, in replica order."""
        return [replica.runner for replica in self.replicas]

    @property
    def num_steps(self) -> int:
        """Device steps of all replicas."""
        return sum(replica.num_steps for replica in self.replicas)

    def stats(self) -> EngineStats:
        """The replicas' stats combined: counts add up, usage and hit rate are averages
        weighted by pool size and admitted prompt tokens."""
        parts = [replica.stats() for replica in self.replicas]
        pages = [replica.config.num_pages - 1 for replica in self.replicas]
        managers = [replica.scheduler.kv_cache_manager for replica in self.replicas]
        queried = sum(manager.prefix_cache_queries for manager in managers)
        return EngineStats(
            num_running=sum(part.num_running for part in parts),
            num_waiting=sum(part.num_waiting for part in parts),
            kv_cache_usage=sum(part.kv_cache_usage * size
                               for part, size in zip(parts, pages)) / sum(pages),
            prefix_cache_hit_rate=(sum(manager.prefix_cache_hits for manager in managers)
                                   / queried if queried else 0.0),
            num_preemptions=sum(part.num_preemptions for part in parts),
            num_steps=sum(part.num_steps for part in parts),
            num_spec_steps=sum(part.num_spec_steps for part in parts),
            num_draft_tokens=sum(part.num_draft_tokens for part in parts),
            num_accepted_tokens=sum(part.num_accepted_tokens for part in parts))

    @property
    def num_free_pages(self) -> int:
        return sum(replica.num_free_pages for replica in self.replicas)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.stats().prefix_cache_hit_rate

    def shutdown(self) -> None:
        """Stops the replica threads (the replicas themselves need no stopping)."""
        self._pool.shutdown(wait=True)


def build_engine(model: Transformer, config: EngineConfig,
                 tokenizer: Tokenizer | None = None) -> Engine | DataParallelEngine:
    """The engine `config`'s parallel sizes ask for, over an already loaded model.

    The model is placed on each replica's mesh (a copy per replica; no copy when it already
    sits on the first replica's mesh as that mesh's layout wants).

    Raises:
        ValueError: The model cannot be split as asked, or there are too few devices
            (`jaxinfer.engine.parallel.ParallelConfigError`); any invalid engine option.
    """
    parallel = config.parallel
    parallel.check_model(model.config)
    meshes = parallel.replica_meshes()
    if meshes is None:
        return Engine(model, config, tokenizer)
    return _replicated(config, tokenizer, [place_on_mesh(model, mesh) for mesh in meshes],
                       meshes)


def load_engine(model: str | os.PathLike[str], *,
                tokenizer: str | os.PathLike[str] | None = None, dtype: str | None = None,
                **engine_options: Any) -> Engine | DataParallelEngine:
    """Loads a model and builds the engine its options ask for.

    The parallel layout is checked against the model's config before any weight is read,
    and the weights are read straight onto the replicas' devices: once, then copied to
    the other replicas in one process; once per replica in a multi-process run, where one
    program cannot copy between device sets that span several hosts.

    Args:
        model: As `Engine.from_pretrained`.
        tokenizer: As `Engine.from_pretrained`.
        dtype: As `Engine.from_pretrained`.
        **engine_options: `EngineConfig` fields, including `tensor_parallel_size`,
            `data_parallel_size` and `expert_parallel_size`.

    Returns:
        An `Engine` when `data_parallel_size` is 1, else a `DataParallelEngine`.

    Raises:
        ValueError: As `build_engine`; an unknown option (the valid ones are listed).
        FileNotFoundError: The model or a given tokenizer does not exist.
    """
    config = engine_config(engine_options)
    overrides = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
    config.parallel.check_model(load_model_config(model, **overrides))
    meshes = config.parallel.replica_meshes()
    loaded_tokenizer = load_tokenizer_of(model, tokenizer)
    if meshes is None or jax.process_count() == 1:
        network = load_model(model, mesh=None if meshes is None else meshes[0], **overrides)
        return build_engine(network, config, loaded_tokenizer)
    models = [load_model(model, mesh=mesh, **overrides) for mesh in meshes]
    return _replicated(config, loaded_tokenizer, models, meshes)


def _replicated(config: EngineConfig, tokenizer: Tokenizer | None, models: list[Transformer],
                meshes: list[Mesh]) -> Engine | DataParallelEngine:
    """One engine per (model, mesh); a DataParallelEngine over them if more than one."""
    replica_config = dataclasses.replace(config, data_parallel_size=1)
    engines = [Engine(network, replica_config, tokenizer, mesh=mesh)
               for network, mesh in zip(models, meshes, strict=True)]
    return engines[0] if len(engines) == 1 else DataParallelEngine(engines)
