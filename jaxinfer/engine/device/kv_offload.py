"""The device side of the host KV tier: copies between the runner's page pool and host memory.

The scheduler plans the copies (`jaxinfer.engine.host.host_block_pool.KVTransfers`); the engine
hands each step's plan to `KVOffloader.issue` before running the step, and calls `collect`
before the next schedule. Every array of the pool pytree is copied alike: the pages
`[L, P, Z, 2K, H]` and whatever auxiliary arrays sit beside them (int8 scales `[L, P, Z, 2K]`,
or the scales and zero points of other KV dtypes), each of which has its page axis at 1. A
block of the host tier is one page of every such array.

Offload (device pool -> host), never on the step's critical path:

1. `issue` runs a jitted gather of the evicted pages (`[n', L, ...]` per pool array, a new
   array, so the step that follows can still take the pool by donation and overwrite those
   pages) and starts each shard's transfer to host memory (`copy_to_host_async`), then
   returns; the step is dispatched right after it.
2. `collect` (before the next schedule) writes the arrived bytes into the host slots and
   commits them, so they become visible to prefix lookups. `seconds["blocked"]` is the time it
   spent taking the host copies, which is waiting for transfers that had not finished while
   the step ran (near 0 when they all overlapped it); `num_ready` and `num_waited` count the
   batches whose gather had and had not finished by then.

Load (host -> device pool), before the step that reads it: `issue` copies the slots out of the
host buffers (fancy indexing copies, so the slots may be reused at once), puts each shard's
part on its devices and scatters them into the pool with a jitted, pool-donating program run
through `ModelRunner.run_on_cache`, ahead of the step in the device's queue. The offloads'
gather is dispatched first: a block evicted this step may be a load's target.

Tensor parallelism: the pool is split over KV heads, so the gathered array is split the same
way and each device's shard travels on its own (`addressable_shards`); the host tier keeps one
buffer per distinct shard (replicas of a shard, over mesh axes that do not split the pool, are
copied once and restored to every device that holds them). No bytes cross devices.

Both programs are compiled per power-of-two bucket of blocks (padding gathers the null page
and scatters into it, where padding tokens write their garbage anyway); `warm_up` compiles
them all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jaxinfer.engine.device.runner import ModelRunner, bucket_for, power_of_two_buckets
from jaxinfer.engine.host.host_block_pool import HostBlockPool, KVTransfers
from jaxinfer.sharding import activate

ShardKey = tuple[tuple[int, int], ...]


def _moved_sharding(sharding: Sharding, ndim: int) -> Sharding:
    """The sharding of a pool array's gathered blocks `[n', L, ...]`: the pool array's, with
    its page axis (1, never split) moved to the front."""
    if not isinstance(sharding, NamedSharding):
        return sharding  # one device: nothing to move
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    if spec[1] is not None:
        raise ValueError(f"the page axis of the KV pool is split ({sharding.spec}); the host "
                         "tier copies whole pages per device")
    return NamedSharding(sharding.mesh, PartitionSpec(spec[1], spec[0], *spec[2:]))


def _shard_key(index: tuple[slice, ...], shape: Sequence[int]) -> ShardKey:
    """A hashable `(start, stop)` per axis of one shard's slice of an array of `shape`."""
    return tuple((part.start or 0, size if part.stop is None else part.stop)
                 for part, size in zip(index, shape))


class KVOffloader:
    """Moves KV blocks between one runner's page pool and a `HostBlockPool` it allocates.

    Attributes:
        runner: The runner whose pool is copied.
        host_pool: The host tier (hand it to the scheduler).
        buckets: Block counts the copy programs are compiled for.
        blocks_to_host: Blocks copied to host memory.
        blocks_to_device: Blocks copied back into the pool.
        bytes_to_host: Bytes copied to host memory (padding not counted).
        bytes_to_device: Bytes copied back.
        seconds: Engine-thread seconds spent on copies: "offload" issuing gathers and
            transfers, "load" issuing loads, "collect" writing arrived bytes into the host
            buffers, and "blocked", within "collect", taking the host copies (waiting for
            transfers still in flight).
        num_ready: Offload batches whose gather had finished when collected.
        num_waited: Offload batches `collect` found still running on the device.
    """

    def __init__(self, runner: ModelRunner, num_bytes: int) -> None:
        """Allocates the host tier for `num_bytes` of host memory.

        Raises:
            ValueError: `num_bytes` does not hold one block (the message gives a block's
                size), or a pool array's page axis is not axis 1 or is split.
        """
        self.runner = runner
        leaves, self._treedef = jax.tree.flatten((runner.pages, runner.scales))
        num_pages = runner.config.num_pages
        specs: list[tuple[tuple[int, ...], np.dtype]] = []
        # Per pool array: the sharding of its gathered blocks, and its distinct shards as
        # (the shard's (start, stop) per block axis, its buffer's index in the host pool).
        self._leaf_layouts: list[tuple[Sharding, list[tuple[ShardKey, int]]]] = []
        for leaf in leaves:
            if leaf.ndim < 2 or leaf.shape[1] != num_pages:
                raise ValueError(f"KV pool array of shape {leaf.shape}: its page axis must be "
                                 f"axis 1, of {num_pages} pages")
            moved = _moved_sharding(leaf.sharding, leaf.ndim)
            block_shape = (leaf.shape[0], *leaf.shape[2:])  # [L, ...]
            indices = moved.addressable_devices_indices_map((1, *block_shape))
            shards: dict[ShardKey, int] = {}
            for index in indices.values():
                key = _shard_key(index[1:], block_shape)
                if key not in shards:
                    shards[key] = len(specs)
                    specs.append((tuple(stop - start for start, stop in key), leaf.dtype))
            self._leaf_layouts.append((moved, sorted(shards.items())))
        block_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
                          for shape, dtype in specs)
        num_blocks = HostBlockPool.blocks_for_bytes(num_bytes, block_bytes)
        if num_blocks < 1:
            raise ValueError(f"kv_offload_bytes = {num_bytes} holds no KV block: one block "
                             f"(a page of every layer) takes {block_bytes} bytes on the host")
        self.host_pool = HostBlockPool(num_blocks, specs)
        # A step moves at most a pool's worth of blocks each way (more is split anyway).
        self.buckets = power_of_two_buckets(1, num_pages)
        self._gather = jax.jit(self._gather_blocks, out_shardings=self._gathered_shardings())
        pool_shardings = [leaf.sharding for leaf in leaves]
        self._scatter = jax.jit(self._scatter_blocks, donate_argnums=(1, 2),
                                out_shardings=(*jax.tree.unflatten(self._treedef,
                                                                   pool_shardings), None))
        self._programs: dict[tuple[str, int], Any] = {}
        # Offloads issued and not yet collected: (host slots, gathered `[n', L, ...]` arrays).
        self._in_flight: list[tuple[list[int], list[jax.Array]]] = []
        self.blocks_to_host = 0
        self.blocks_to_device = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.seconds = dict.fromkeys(("offload", "load", "collect", "blocked"), 0.0)
        self.num_ready = 0
        self.num_waited = 0

    # ------------------------------------------------------------------ programs

    def _gathered_shardings(self) -> list[Sharding] | None:
        if self.runner.mesh is None:
            return None
        return [moved for moved, _ in self._leaf_layouts]

    @staticmethod
    def _gather_blocks(leaves: list[jax.Array], block_ids: jax.Array) -> list[jax.Array]:
        """`[n', L, ...]` the pages `block_ids` `[n']` of every pool array `[L, P, ...]`."""
        return [jnp.moveaxis(leaf[:, block_ids], 1, 0) for leaf in leaves]

    def _scatter_blocks(self, state: Any, pages: jax.Array, scales: Any,
                        block_ids: jax.Array, blocks: list[jax.Array]) -> tuple[Any, Any, None]:
        """The pool with `blocks` (`[n', L, ...]` per pool array) written to pages
        `block_ids` `[n']`; a `run_on_cache` program (the model state is not read)."""
        del state
        leaves = jax.tree.leaves((pages, scales))
        written = [leaf.at[:, block_ids].set(jnp.moveaxis(block, 0, 1))  # [L, P, ...]
                   for leaf, block in zip(leaves, blocks)]
        pages, scales = jax.tree.unflatten(self._treedef, written)
        return pages, scales, None

    def _program(self, kind: str, bucket: int) -> Any:
        """The compiled gather or scatter for `bucket` blocks (compiled now if needed)."""
        program = self._programs.get((kind, bucket))
        if program is not None:
            return program
        runner = self.runner
        leaves = jax.tree.leaves((runner.pages, runner.scales))
        ids = jax.ShapeDtypeStruct((bucket,), jnp.int32)
        if kind == "gather":
            lowered = self._gather.lower(leaves, ids)
        else:
            blocks = [jax.ShapeDtypeStruct((bucket, leaf.shape[0], *leaf.shape[2:]),
                                           leaf.dtype, sharding=moved)
                      for leaf, (moved, _) in zip(leaves, self._leaf_layouts)]
            with activate(runner.mesh, runner.layout):
                lowered = self._scatter.lower(runner.state, runner.pages, runner.scales, ids,
                                              blocks)
        program = self._programs[(kind, bucket)] = lowered.compile()
        return program

    def warm_up(self) -> None:
        """Compiles the gather and the scatter for every bucket."""
        for bucket in self.buckets:
            self._program("gather", bucket)
            self._program("scatter", bucket)

    @property
    def compilations(self) -> int:
        """Copy programs compiled so far (constant after `warm_up`)."""
        return len(self._programs)

    # ------------------------------------------------------------------ copies

    def issue(self, transfers: KVTransfers) -> None:
        """Starts one step's copies: the offloads' gather and transfers to host, then the
        loads into the pool. Call it before running the step."""
        largest = self.buckets[-1]
        started = time.perf_counter()
        for first in range(0, len(transfers.offloads), largest):
            self._offload(transfers.offloads[first:first + largest])
        loading = time.perf_counter()
        for first in range(0, len(transfers.loads), largest):
            self._load(transfers.loads[first:first + largest])
        self.seconds["offload"] += loading - started
        self.seconds["load"] += time.perf_counter() - loading

    def _padded_ids(self, block_ids: Sequence[int]) -> tuple[int, np.ndarray]:
        """The bucket for `block_ids` and the ids padded to it with the null page."""
        bucket = bucket_for(len(block_ids), self.buckets)
        padded = np.zeros(bucket, np.int32)  # [n']
        padded[:len(block_ids)] = block_ids
        return bucket, padded

    def _offload(self, offloads: list[tuple[int, int]]) -> None:
        block_ids = [block for block, _ in offloads]
        bucket, padded = self._padded_ids(block_ids)
        leaves = jax.tree.leaves((self.runner.pages, self.runner.scales))
        gathered = self._program("gather", bucket)(leaves, padded)  # [n', L, ...] each
        for array in gathered:
            for shard in array.addressable_shards:
                shard.data.copy_to_host_async()
        self._in_flight.append(([slot for _, slot in offloads], gathered))
        self.blocks_to_host += len(offloads)
        self.bytes_to_host += len(offloads) * self.host_pool.block_bytes

    def collect(self, wait: bool = True) -> int:
        """Writes the offloads that have arrived into their host slots and commits them.

        Args:
            wait: Also wait for those still in flight (the engine does before scheduling,
                so that lookups see every evicted block); False takes only the arrived ones.

        Returns:
            The blocks committed.
        """
        started = time.perf_counter()
        committed = 0
        remaining = []
        for slots, gathered in self._in_flight:
            ready = all(shard.data.is_ready() for array in gathered
                        for shard in array.addressable_shards)
            if not ready and not wait:
                remaining.append((slots, gathered))
                continue
            if ready:
                self.num_ready += 1
            else:
                self.num_waited += 1
            # Taking the host copies returns at once when the transfer overlapped the step;
            # otherwise this is the time the engine waited for it (counted either way: a
            # finished gather may still have its transfer to host in flight).
            waited = time.perf_counter()
            host = self._to_host(gathered, len(slots))
            self.seconds["blocked"] += time.perf_counter() - waited
            self.host_pool.write(slots, host)
            self.host_pool.commit(slots)
            committed += len(slots)
        self._in_flight = remaining
        self.seconds["collect"] += time.perf_counter() - started
        return committed

    def _to_host(self, gathered: list[jax.Array], count: int) -> list[np.ndarray]:
        """`[count, ...]` per host buffer, from each distinct shard of the gathered arrays."""
        buffers: list[np.ndarray | None] = [None] * len(self.host_pool.buffers)
        for array, (_, shards) in zip(gathered, self._leaf_layouts):
            wanted = dict(shards)
            for shard in array.addressable_shards:
                key = _shard_key(shard.index[1:], array.shape[1:])
                buffer = wanted.pop(key, None)
                if buffer is not None:
                    buffers[buffer] = np.asarray(shard.data)[:count]
        return buffers

    def _load(self, loads: list[tuple[int, int]]) -> None:
        slots = [slot for slot, _ in loads]
        bucket, padded = self._padded_ids([block for _, block in loads])
        # Padding rows repeat the first slot; they are written to the null page.
        host = self.host_pool.read(slots + [slots[0]] * (bucket - len(slots)))  # [n', ...]
        leaves = jax.tree.leaves((self.runner.pages, self.runner.scales))
        blocks = []
        for leaf, (moved, shards) in zip(leaves, self._leaf_layouts):
            shape = (bucket, leaf.shape[0], *leaf.shape[2:])  # [n', L, ...]
            by_key = dict(shards)
            parts = [jax.device_put(host[by_key[_shard_key(index[1:], shape[1:])]], device)
                     for device, index in moved.addressable_devices_indices_map(shape).items()]
            blocks.append(jax.make_array_from_single_device_arrays(shape, moved, parts))
        self.runner.run_on_cache(self._program("scatter", bucket), padded, blocks)
        self.blocks_to_device += len(loads)
        self.bytes_to_device += len(loads) * self.host_pool.block_bytes

    @property
    def copy_seconds(self) -> float:
        """Engine-thread seconds spent on copies, waiting included."""
        return self.seconds["offload"] + self.seconds["load"] + self.seconds["collect"]

