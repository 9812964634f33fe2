"""Data parallelism: independent engine replicas behind one Engine-shaped front.

Each replica is a whole `Engine` (scheduler, page pool, jitted step) on its own TP x EP
sub-mesh (`jaxinfer.engine.parallel` says why replicas rather than one sharded batch). A new
request goes to the replica with the fewest unfinished requests (ties: fewest waiting, then
the lowest index), and stays there: its pages live in that replica's pool. `step()` steps
every replica that has work, each in its own thread, so their device steps overlap (JAX
releases the GIL while a step runs), and returns all their outputs; in a multi-process run
the replicas step one after another instead, in the order process 0 sends their steps to
the other processes.

`jaxinfer.engine.factory` builds it (`load_engine`, `build_engine`) when `data_parallel_size`
is above 1.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax

from jaxinfer.engine.client import EngineStats, add_counts
from jaxinfer.engine.core import Engine
from jaxinfer.engine.device.runner import ModelRunner
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.input_processor import ProcessedRequest, Prompt
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import SamplingParams

# The host KV tier's EngineStats counts, which add up over replicas.
_HOST_TIER_TOTALS = ("host_cache_queries", "host_cache_hits", "host_cache_hit_tokens",
                     "num_host_blocks", "num_free_host_blocks", "num_swapped_blocks",
                     "kv_bytes_to_host", "kv_bytes_to_device", "kv_copy_seconds",
                     "kv_copy_blocked_seconds")


class DataParallelEngine:
    """`data_parallel_size` engine replicas with `Engine`'s request interface.

    Args:
        replicas: The replica engines (same model, same options, each on its own devices).
    """

    def __init__(self, replicas: list[Engine]) -> None:
        if not replicas:
            raise ValueError("a DataParallelEngine needs at least one replica")
        self.replicas = replicas
        first = replicas[0].config
        self.config = dataclasses.replace(first, parallel=dataclasses.replace(
            first.parallel, data_parallel_size=len(replicas)))
        self.model_config = replicas[0].model_config
        self.tokenizer = replicas[0].tokenizer
        self.speculative = replicas[0].speculative
        self._owner: dict[str, Engine] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(replicas), thread_name_prefix="jaxinfer-replica")

    # ------------------------------------------------------------------ Engine's interface

    def process_request(self, request_id: str, prompt: Prompt,
                        sampling_params: SamplingParams | None = None, *,
                        cache_salt: str | None = None,
                        speculative: bool = True) -> ProcessedRequest:
        """Checks a request (every replica checks alike; see `Engine.process_request`)."""
        return self.replicas[0].process_request(request_id, prompt, sampling_params,
                                                cache_salt=cache_salt, speculative=speculative)

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Queues a checked request on the least-loaded replica.

        Raises:
            RequestError: The id is in use on any replica.
        """
        request_id = processed.request_id
        if request_id in self._owner:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        replica = min(self.replicas, key=lambda engine: (
            engine.num_unfinished_requests, len(engine.scheduler.waiting),
            self.replicas.index(engine)))
        replica.add_processed_request(processed)
        self._owner[request_id] = replica

    def add_request(self, request_id: str, prompt: Prompt,
                    sampling_params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, speculative: bool = True) -> None:
        """Checks and queues a request on the least-loaded replica (see `Engine.add_request`).

        Raises:
            RequestError: As `Engine.add_request`, including an id in use on any replica.
        """
        self.add_processed_request(self.process_request(
            request_id, prompt, sampling_params, cache_salt=cache_salt,
            speculative=speculative))

    @property
    def runners(self) -> list[ModelRunner]:
        """The replicas' device runners, in replica order."""
        return [replica.runner for replica in self.replicas]

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
    def num_steps(self) -> int:
        """Device steps of all replicas."""
        return sum(replica.num_steps for replica in self.replicas)

    def stats(self) -> EngineStats:
        """The replicas' stats combined: counts add up, usage and hit rate are averages
        weighted by pool size and admitted prompt tokens."""
        parts = [replica.stats() for replica in self.replicas]
        pages = [replica.config.num_pages - 1 for replica in self.replicas]
        queried = sum(part.prefix_cache_queries for part in parts)
        hits = sum(part.prefix_cache_hits for part in parts)
        return EngineStats(
            num_running=sum(part.num_running for part in parts),
            num_waiting=sum(part.num_waiting for part in parts),
            kv_cache_usage=sum(part.kv_cache_usage * size
                               for part, size in zip(parts, pages)) / sum(pages),
            prefix_cache_hit_rate=hits / queried if queried else 0.0,
            num_preemptions=sum(part.num_preemptions for part in parts),
            num_steps=sum(part.num_steps for part in parts),
            num_spec_steps=sum(part.num_spec_steps for part in parts),
            num_draft_tokens=sum(part.num_draft_tokens for part in parts),
            num_accepted_tokens=sum(part.num_accepted_tokens for part in parts),
            num_free_pages=sum(part.num_free_pages for part in parts),
            prefix_cache_queries=queried, prefix_cache_hits=hits,
            num_unfinished_requests=sum(part.num_unfinished_requests for part in parts),
            accepted_per_position=add_counts(*(part.accepted_per_position for part in parts)),
            iteration_tokens=add_counts(*(part.iteration_tokens for part in parts)),
            iteration_tokens_sum=sum(part.iteration_tokens_sum for part in parts),
            **{name: sum(getattr(part, name) for part in parts) for name in _HOST_TIER_TOTALS})

    @property
    def num_free_pages(self) -> int:
        return sum(replica.num_free_pages for replica in self.replicas)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.stats().prefix_cache_hit_rate

    def shutdown(self) -> None:
        """Stops the replica threads (the replicas themselves need no stopping)."""
        self._pool.shutdown(wait=True)
