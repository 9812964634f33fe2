"""The host-memory KV tier: preallocated NumPy buffers of evicted prefix blocks, with an LRU.

When the device pool (`BlockPool`) evicts a cached block to reuse its page, the block's keys
and values (every layer, and every auxiliary array of the pool: int8 scales, zero points) are
copied here under the same chained block hash, so that a later request with that prefix gets
them copied back instead of recomputed. The device side does the copies
(`jaxinfer.engine.device.kv_offload`); this module only keeps the slots and the buffers, and
imports no jax.

A slot is one block's worth of every buffer. Each slot is in exactly one state:

- free: no hash, in the free list;
- pending: a hash is reserved and the device-to-host copy is in flight. A pending slot is not
  found by `lookup` (its bytes are not here yet) and is never evicted; `commit` makes it cached;
- cached: holds a hash's bytes, found by `lookup`; evictable (in the LRU) unless pinned.

Pins are references held by preempted requests whose blocks were swapped out (`pin`/`unpin`):
a pinned slot is not evicted, so the request finds its blocks when it resumes. A pending slot
may be pinned too; it stays pinned once committed.

Buffers are laid out block-major, `[N, ...]` with N the slot count, so one slot's bytes of a
buffer are contiguous. What a buffer holds (one device shard of one pool array, without its
page axis) is the device side's business; the pool only checks that writes fit.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

BlockHash = Hashable


class HostBlockPool:
    """Slots of host memory holding evicted KV blocks, keyed by block hash, with an LRU.

    Attributes:
        num_blocks: Slots in the pool.
        block_bytes: Bytes of one slot over all buffers.
        buffers: `[N, ...]` one NumPy array per device buffer (a shard of a pool array).
        num_lookups: Blocks looked up (`lookup` calls).
        num_hits: Of those, the blocks found.
        num_stored: Slots committed (blocks copied here).
        num_evictions: Cached slots whose hash was dropped to make room.
    """

    def __init__(self, num_blocks: int, block_specs: Sequence[tuple[tuple[int, ...], np.dtype]]
                 ) -> None:
        """Allocates every buffer up front (`np.zeros`: the OS maps the pages as they are
        first written, so an idle tier costs address space, not memory).

        Args:
            num_blocks: Slots; at least 1.
            block_specs: Per buffer, the shape and dtype of one block of it.

        Raises:
            ValueError: `num_blocks` < 1 or no buffers.
        """
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks = {num_blocks!r}: need an integer >= 1")
        if not block_specs:
            raise ValueError("a host block pool needs at least one buffer")
        self.num_blocks = num_blocks
        self.buffers = [np.zeros((num_blocks, *shape), dtype)  # [N, ...]
                        for shape, dtype in block_specs]
        self.block_bytes = sum(buffer[0].nbytes for buffer in self.buffers)
        self._hash_of_slot: list[BlockHash | None] = [None] * num_blocks
        self._slot_of_hash: dict[BlockHash, int] = {}
        self._pending: set[int] = set()
        self._pins = [0] * num_blocks
        self._free = collections.deque(range(num_blocks))
        # Cached, unpinned slots; insertion order is eviction order (head: least recent).
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_lookups = 0
        self.num_hits = 0
        self.num_stored = 0
        self.num_evictions = 0

    @staticmethod
    def blocks_for_bytes(num_bytes: int, block_bytes: int) -> int:
        """How many slots of `block_bytes` fit in `num_bytes` (0 if not one)."""
        return num_bytes // block_bytes if block_bytes > 0 else 0

    @property
    def num_free_blocks(self) -> int:
        """Slots `reserve` can take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Slots holding a hash, pending or cached, pinned or not."""
        return len(self._slot_of_hash)

    @property
    def num_pending_blocks(self) -> int:
        """Slots whose copy from the device is still in flight."""
        return len(self._pending)

    @property
    def num_pinned_blocks(self) -> int:
        """Slots held by swapped-out requests."""
        return sum(1 for count in self._pins if count)

    @property
    def hit_rate(self) -> float:
        """Blocks found over blocks looked up (0 before any lookup)."""
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether `block_hash` has a slot, pending or cached (no lookup is counted)."""
        return block_hash in self._slot_of_hash

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot reserved for or holding `block_hash`, pending or not, or None."""
        return self._slot_of_hash.get(block_hash)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Returns the slot holding `block_hash`'s bytes and marks it most recently used.

        A pending slot counts as a miss: its bytes have not arrived.
        """
        self.num_lookups += 1
        slot = self._slot_of_hash.get(block_hash)
        if slot is None or slot in self._pending:
            return None
        self.num_hits += 1
        if slot in self._evictable:
            self._evictable.move_to_end(slot)
        return slot

    def reserve(self, block_hash: BlockHash) -> int | None:
        """Takes a slot for `block_hash`, pending until `commit`.

        Free slots go first, then the least recently used evictable one (its hash dropped).

        Returns:
            The slot, or None when the hash already has one (nothing to copy) or every slot is
            pending or pinned (the block is dropped, as without a host tier).
        """
        if block_hash in self._slot_of_hash:
            slot = self._slot_of_hash[block_hash]
            if slot in self._evictable:
                self._evictable.move_to_end(slot)
            return None
        if self._free:
            slot = self._free.popleft()
        elif self._evictable:
            slot, _ = self._evictable.popitem(last=False)
            del self._slot_of_hash[self._hash_of_slot[slot]]
            self.num_evictions += 1
        else:
            return None
        self._hash_of_slot[slot] = block_hash
        self._slot_of_hash[block_hash] = slot
        self._pending.add(slot)
        return slot

    def commit(self, slots: Iterable[int]) -> None:
        """Marks pending slots as holding their bytes (the copies have been written).

        Raises:
            ValueError: A slot is not pending.
        """
        for slot in slots:
            if slot not in self._pending:
                raise ValueError(f"host slot {slot} is not pending")
            self._pending.remove(slot)
            self.num_stored += 1
            if not self._pins[slot]:
                self._evictable[slot] = None

    def abandon(self, slots: Iterable[int]) -> None:
        """Frees pending slots whose copy will never arrive (their pins are dropped too)."""
        for slot in slots:
            if slot not in self._pending:
                raise ValueError(f"host slot {slot} is not pending")
            self._pending.remove(slot)
            del self._slot_of_hash[self._hash_of_slot[slot]]
            self._hash_of_slot[slot] = None
            self._pins[slot] = 0
            self._free.append(slot)

    def pin(self, slot: int) -> None:
        """Adds a reference that keeps the slot from being evicted."""
        self._check_holds(slot)
        self._pins[slot] += 1
        self._evictable.pop(slot, None)

    def unpin(self, slot: int) -> None:
        """Drops a `pin`; an unpinned cached slot becomes evictable again (most recent).

        Raises:
            ValueError: The slot is not pinned.
        """
        if self._pins[slot] <= 0:
            raise ValueError(f"host slot {slot} is not pinned")
        self._pins[slot] -= 1
        if not self._pins[slot] and slot not in self._pending \
                and self._hash_of_slot[slot] is not None:
            self._evictable[slot] = None

    def write(self, slots: Sequence[int], blocks: Sequence[np.ndarray]) -> None:
        """Copies blocks into pending slots, one `[n, ...]` array per buffer.

        Raises:
            ValueError: A slot is not pending, or the arrays do not match the buffers.
        """
        stray = [slot for slot in slots if slot not in self._pending]
        if stray:
            raise ValueError(f"host slots {stray} are not pending; only reserved slots are "
                             "written")
        if len(blocks) != len(self.buffers):
            raise ValueError(f"{len(blocks)} arrays for {len(self.buffers)} buffers")
        index = np.asarray(slots, np.int64)  # [n]
        for buffer, block in zip(self.buffers, blocks):
            if block.shape != (len(slots), *buffer.shape[1:]):
                raise ValueError(f"blocks of shape {block.shape} do not fit buffer "
                                 f"{buffer.shape} for {len(slots)} slots")
            buffer[index] = block

    def read(self, slots: Sequence[int]) -> list[np.ndarray]:
        """Copies of the blocks in cached slots, one `[n, ...]` array per buffer.

        They are copies, so the slots may be reused right away while the arrays travel.

        Raises:
            ValueError: A slot holds no committed bytes.
        """
        for slot in slots:
            if self._hash_of_slot[slot] is None or slot in self._pending:
                raise ValueError(f"host slot {slot} holds no committed block")
        index = np.asarray(slots, np.int64)  # [n]
        return [buffer[index] for buffer in self.buffers]  # fancy indexing copies

    def _check_holds(self, slot: int) -> None:
        if not 0 <= slot < self.num_blocks or self._hash_of_slot[slot] is None:
            raise ValueError(f"host slot {slot} holds no block")


class KVTransfers:
    """The copies between the device pool and the host tier that one step needs, planned by
    the KV cache manager while scheduling and issued by the device side before the step.

    Attributes:
        offloads: `(device block, host slot)` pairs: copy the page to the (pending) slot. The
            page must be read before the step runs, since the block may be reused by it.
        loads: `(host slot, device block)` pairs: copy the slot into the freshly allocated
            block before the step that reads it.
    """

    __slots__ = ("loads", "offloads")

    def __init__(self, offloads: list[tuple[int, int]] | None = None,
                 loads: list[tuple[int, int]] | None = None) -> None:
        self.offloads = offloads if offloads is not None else []
        self.loads = loads if loads is not None else []

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)

    def __repr__(self) -> str:
        return f"KVTransfers(offloads={self.offloads}, loads={self.loads})"
