"""The pool of physical KV-cache blocks (pages): free list, reference counts, prefix-cache LRU.

A block is `block_size` token slots of the paged KV cache, the same slot in every layer. The pool
only does the bookkeeping; it never sees a device array. Block ids are `0 .. num_blocks - 1`.

Block 0 is the null block (`NULL_BLOCK_ID`): it is never handed out, so the device side can pad
page tables with 0 and let padding tokens write their garbage there. `capacity` is therefore
`num_blocks - 1`, and `num_free_blocks` counts only the blocks that `allocate` can return.

Every other block is in exactly one of three states:

- free: ref count 0, no hash, in the free list;
- in use: ref count >= 1 (one per request whose block table holds it), with or without a hash;
- evictable: ref count 0 but still holding a full, hashed prefix block, kept in the LRU so a later
  request with the same prefix can reuse it (`touch`). Eviction, which drops the hash, happens
  only inside `allocate` and only once the free list is empty, least recently freed first.

A hash maps to at most one block and a block holds at most one hash (`cache_block` refuses a
second block for a hash that is already cached), so `lookup` is unambiguous.

With `record_evictions` (a host KV tier is on), each eviction is also appended to `evicted` as
`(block_id, hash)`, for the caller to copy the page to host memory before the step that reuses
it writes there (`take_evicted` drains the list).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable

NULL_BLOCK_ID = 0

BlockHash = Hashable


class NoFreeBlocksError(RuntimeError):
    """`BlockPool.allocate` was asked for more blocks than are free or evictable."""


class BlockPool:
    """Physical KV-cache blocks with reference counts and an LRU of cached, unused blocks.

    Attributes:
        num_blocks: Total block ids, the null block included.
        num_lookups: `lookup` calls so far.
        num_lookup_hits: `lookup` calls that found a cached block.
        num_evictions: Cached blocks whose hash was dropped to make room for an allocation.
        record_evictions: Whether evictions are listed for `take_evicted`.
    """

    def __init__(self, num_blocks: int, record_evictions: bool = False) -> None:
        """Creates a pool whose blocks are all free.

        Args:
            num_blocks: Total block ids, including the reserved null block 0; at least 2.
            record_evictions: List each eviction's block and hash for `take_evicted`.

        Raises:
            ValueError: `num_blocks` is not an integer >= 2.
        """
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
            raise ValueError(f"num_blocks = {num_blocks!r}: need an integer >= 2 (block 0 is the "
                             "reserved null block)")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[BlockHash | None] = [None] * num_blocks
        self._block_of_hash: dict[BlockHash, int] = {}
        self._free = collections.deque(range(1, num_blocks))
        # Insertion order is the eviction order: the head is the least recently freed block.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_lookups = 0
        self.num_lookup_hits = 0
        self.num_evictions = 0
        self.record_evictions = record_evictions
        self._evicted: list[tuple[int, BlockHash]] = []

    @property
    def capacity(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix-cache hash, in use or evictable."""
        return len(self._block_of_hash)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks with ref count 0, waiting in the LRU."""
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        """Returns how many block tables hold `block_id`."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """Returns the prefix-cache hash `block_id` holds, or None."""
        self._check_id(block_id)
        return self._hash_of_block[block_id]

    def is_evictable(self, block_id: int) -> bool:
        """Whether `block_id` is cached, unused and so may be evicted by the next allocation."""
        self._check_id(block_id)
        return block_id in self._evictable

    def allocate(self, num_blocks: int) -> list[int]:
        """Hands out `num_blocks` blocks with ref count 1 and no hash.

        Free blocks go first; only when there are none left are evictable cached blocks taken,
        least recently freed first, and their hashes dropped.

        Args:
            num_blocks: How many blocks to allocate (0 returns an empty list).

        Returns:
            The block ids, never including the null block.

        Raises:
            NoFreeBlocksError: Fewer than `num_blocks` blocks are free or evictable; the pool is
                left unchanged (the caller checks `num_free_blocks` first to avoid it).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks = {num_blocks}: must be >= 0")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, only "
                                    f"{self.num_free_blocks} free or evictable")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                evicted_hash = self._hash_of_block[block_id]
                del self._block_of_hash[evicted_hash]
                self._hash_of_block[block_id] = None
                self.num_evictions += 1
                if self.record_evictions:
                    self._evicted.append((block_id, evicted_hash))
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """Returns and forgets the `(block_id, hash)` evictions since the last call, in order
        (always empty without `record_evictions`). The block ids are already reallocated: their
        pages still hold the evicted keys and values until the next step writes them."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference to each block, in the order given.

        A block whose count reaches 0 goes back to the free list if it holds no hash, or to the
        tail of the evictable LRU if it does. Pass a request's blocks last-first so that its tail
        blocks, the least likely to be shared, are evicted before its head.

        Raises:
            ValueError: A block is the null block or already has ref count 0 (a double free).
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than allocated or touched")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hash_of_block[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds one reference to each block, taking unused cached blocks out of the LRU.

        This is how a prefix-cache hit is shared: the block is not copied or rewritten, only
        counted once more.

        Raises:
            ValueError: A block is the null block or is free (ref count 0 and no hash): a free
                block holds nothing worth reusing and must come from `allocate`.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                if block_id not in self._evictable:
                    raise ValueError(f"block {block_id} is free; only cached or in-use blocks "
                                     "can be touched")
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Registers an in-use block as holding the full prefix block `block_hash`.

        Args:
            block_id: A block with ref count >= 1 whose slots are all written.
            block_hash: The chained hash of the block's tokens and everything before them.

        Returns:
            True if the block now holds the hash (also when it already did); False if another
            block already holds that hash, which is then kept and this block stays uncached.

        Raises:
            ValueError: The block is not in use, or already holds a different hash.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not in use; only written blocks are cached")
        current = self._hash_of_block[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already holds another hash")
            return True
        if block_hash in self._block_of_hash:
            return False
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
        return True

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Returns the block holding `block_hash` (in use or evictable), or None.

        The lookup does not take a reference; `touch` the block before the next allocation can
        evict it.
        """
        self.num_lookups += 1
        block_id = self._block_of_hash.get(block_hash)
        if block_id is not None:
            self.num_lookup_hits += 1
        return block_id

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            kind = "the reserved null block" if block_id == NULL_BLOCK_ID else "out of range"
            raise ValueError(f"block id {block_id} is {kind} (valid: 1..{self.num_blocks - 1})")
