"""Per-request block tables over the BlockPool, with a hash-chained prefix cache of full blocks.

A request's block table lists the physical blocks that hold its tokens: token `p` lives in slot
`p % block_size` of block `table[p // block_size]`. The prefix cache lets a new request start
from blocks another request already wrote, when their tokens (and everything before them) match.

Invariants:

- A table holds exactly `ceil(tokens_allocated / block_size)` blocks, where tokens_allocated
  is the request's computed tokens plus those scheduled this step; `allocate_slots` grows it all
  at once or not at all.
- Only FULL blocks are hashed and cached, and only once every token in them is computed
  (`cache_full_blocks`, called after the step that wrote them). A partially filled block is
  never shared, so a block that is cached is never written again: new tokens always go to
  blocks past the shared prefix.
- Block `i`'s hash chains block `i - 1`'s hash with block `i`'s tokens (`hash_block`), so equal
  hashes mean equal whole prefixes, not just equal blocks. The request's `cache_salt`, if any,
  goes into block 0's hash.
- A hash is registered once: if an identical block is already cached (two requests computed
  the same prefix at the same time), the first stays cached and the duplicate stays private to
  its request, going back to the free list when released.
- A prefix hit never covers the whole request: at least its last known token is recomputed so
  that the step that computes it has logits to sample the next token from.
- Each table entry holds one reference on its block; `free` drops them, last block first, so the
  request's tail is evicted before its head.

Host tier (a `HostBlockPool`, when `kv_offload_bytes` > 0): every cached block the device pool
evicts while allocating is given a host slot under its hash and an offload `(block, slot)` is
planned; on admission, after the device hit, the chain continues on the host
(`get_host_hits`), and `allocate_slots` allocates fresh blocks for those host blocks and plans
loads `(slot, block)`. Those tokens count as computed, and the blocks are hashed after the step
like any computed block. `swap_out` gives a request being preempted host copies of its full
computed blocks, pinned until it is readmitted or ends (`release_swapped`). The step's
planned copies are collected with `take_transfers`; the device side must issue the offloads
before the loads and both before the step (an evicted page may be a load's target).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

from jaxinfer.engine.host.block_pool import BlockPool
from jaxinfer.engine.host.host_block_pool import HostBlockPool, KVTransfers
from jaxinfer.engine.host.request import Request


class TokenSequence(Protocol):
    """What block allocation reads of a sequence: a `Request`, or a proposer's own record of
    one (the draft model keeps its own pages for the same request id); prefix caching needs
    a whole `Request`."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

BlockHash = bytes


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int],
               extra: object = None) -> BlockHash:
    """Returns the chained hash of one full block of tokens.

    SHA-256 over a tagged, length-prefixed encoding, so the hash is the same in every process
    and on every machine, and collisions are not a practical concern (a collision would make a
    request read another prompt's keys and values).

    Args:
        parent_hash: The previous block's hash, or None for a request's first block.
        token_ids: The block's tokens (each fits in a signed 64-bit integer).
        extra: Anything else that changes the block's keys and values (a cache salt, an adapter
            id); it enters as `repr(extra)`, so use values with a stable repr (str, int, tuples
            of those). None adds nothing.

    Returns:
        The 32-byte digest.
    """
    digest = hashlib.sha256()
    if parent_hash is None:
        digest.update(b"\x00")
    else:
        digest.update(b"\x01" + len(parent_hash).to_bytes(4, "little") + parent_hash)
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra is not None:
        encoded = repr(extra).encode()
        digest.update(b"\x02" + len(encoded).to_bytes(4, "little") + encoded)
    return digest.digest()


class KVCacheManager:
    """Block tables for the scheduler's requests, backed by one BlockPool.

    Attributes:
        block_size: Token slots per block.
        enable_prefix_caching: Whether full blocks are cached and reused across requests.
        block_pool: The pool the blocks come from.
        prefix_cache_queries: Known tokens of every request admitted with `allocate_slots`
            (counted at each admission, re-admissions after preemption included).
        prefix_cache_hits: Of those, the tokens that came from the device prefix cache.
        host_pool: The host tier, or None.
        host_hit_tokens: Of `prefix_cache_queries`, the tokens loaded from the host tier.
        num_swapped_blocks: Blocks given host copies by `swap_out`.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True,
                 host_pool: HostBlockPool | None = None) -> None:
        """Creates a manager over `num_blocks` blocks (block 0 reserved as the null block).

        Args:
            num_blocks: Device blocks, the null block included.
            block_size: Token slots per block.
            enable_prefix_caching: Cache and reuse full blocks.
            host_pool: The host tier evicted blocks go to (needs prefix caching); None: off.

        Raises:
            ValueError: `block_size` is not a positive integer, `num_blocks` < 2, or a host
                pool without prefix caching.
        """
        if host_pool is not None and not enable_prefix_caching:
            raise ValueError("a host KV tier keeps evicted prefix-cache blocks; it needs "
                             "enable_prefix_caching")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size = {block_size!r}: must be a positive integer")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, record_evictions=host_pool is not None)
        self.host_pool = host_pool
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_hit_tokens = 0
        self.num_swapped_blocks = 0
        # The copies planned since the last `take_transfers`.
        self._transfers = KVTransfers()
        # Host slots each swapped-out request holds a pin on.
        self._swapped: dict[str, list[int]] = {}
        # Host slots of the loads planned since the last `take_transfers`, pinned till then.
        self._load_pins: list[int] = []
        self._block_tables: dict[str, list[int]] = {}
        # Hash chain over each request's known full blocks, extended lazily.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of each table cache_full_blocks has already handled.
        self._num_handled_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free plus evictable)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests' block tables, in [0, 1]."""
        return 1.0 - self.block_pool.num_free_blocks / self.block_pool.capacity

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of admitted tokens served by the prefix cache (0 before any admission)."""
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def get_block_table(self, request_id: str) -> list[int]:
        """Returns a copy of the request's block table (empty if it holds no blocks)."""
        return list(self._block_tables.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Finds the longest cached prefix of the request's full blocks.

        The hit stops at the first block that is not cached and never includes the block of the
        last known token, which must be recomputed to sample from. The blocks are not
        referenced yet: pass them to `allocate_slots` before anything else allocates.

        Args:
            request: A request that holds no blocks (waiting or preempted).

        Returns:
            The cached block ids, in order, and the number of tokens they hold.

        Raises:
            ValueError: The request already holds blocks.
        """
        if request.request_id in self._block_tables:
            raise ValueError(f"request {request.request_id!r} already holds blocks; only "
                             "requests being admitted look up the prefix cache")
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._request_block_hashes(request, max_hit_blocks)
        blocks = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self.block_pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def get_host_hits(self, request: Request, num_device_blocks: int) -> list[int]:
        """Continues a device prefix hit on the host tier.

        Args:
            request: A request being admitted (as for `get_computed_blocks`).
            num_device_blocks: Blocks of its device hit; the host is looked up for the next
                hashes of the chain, until the first miss.

        Returns:
            The host slots holding the next blocks, in order (empty without a host tier); like
            the device hit, never the block of the last known token. Pass them to
            `allocate_slots` before anything else reserves host slots.
        """
        if self.host_pool is None or not self.enable_prefix_caching:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._request_block_hashes(request, max_hit_blocks)
        slots = []
        for block_hash in hashes[num_device_blocks:max_hit_blocks]:
            slot = self.host_pool.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def allocate_slots(self, request: TokenSequence, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = (),
                       num_lookahead_tokens: int = 0,
                       host_hit_slots: Sequence[int] = ()) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens of the request, all or nothing.

        Args:
            request: The request; its `num_computed_tokens` tokens are already in its blocks.
            num_new_tokens: Tokens to be computed this step, after the prefix-cache hit
                (speculative draft tokens included).
            new_computed_blocks: On admission only, the prefix-cache hit from
                `get_computed_blocks`; they are referenced and put at the head of the table.
            num_lookahead_tokens: How many of the new tokens are speculative drafts, which
                lie past the request's known tokens (`free_excess_blocks` gives back the
                blocks of those that are rejected).
            host_hit_slots: On admission only, the host-tier hit from `get_host_hits` (the
                blocks right after `new_computed_blocks`): fresh blocks are allocated for them
                and loads planned; their tokens count as already computed.

        Returns:
            The newly allocated block ids (possibly an empty list: test with `is None`), or
            None if the pool cannot provide them, in which case nothing changed.

        Raises:
            ValueError: The blocks would cover more than the request's known tokens, or
                computed blocks are passed for a request that already holds blocks.
        """
        table = self._block_tables.get(request.request_id)
        if (new_computed_blocks or host_hit_slots) and table is not None:
            raise ValueError(f"request {request.request_id!r} already holds blocks; computed "
                             "blocks are only accepted on admission")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens = {num_new_tokens}: must be >= 0")
        num_held = len(table) if table else 0
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        num_host_tokens = len(host_hit_slots) * self.block_size
        num_total_tokens = (request.num_computed_tokens + num_hit_tokens + num_host_tokens
                            + num_new_tokens)
        if num_total_tokens > request.num_tokens + num_lookahead_tokens:
            raise ValueError(f"request {request.request_id!r}: {num_total_tokens} tokens asked "
                             f"for, only {request.num_tokens} are known (plus "
                             f"{num_lookahead_tokens} drafts)")
        num_needed = -(-num_total_tokens // self.block_size)
        num_new_blocks = max(num_needed - num_held - len(new_computed_blocks), 0)
        # Hit blocks sitting in the LRU count as free, but touching them takes them out of it,
        # so they cannot also be handed out as new blocks.
        num_evictable_hits = sum(1 for block_id in new_computed_blocks
                                 if self.block_pool.is_evictable(block_id))
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        if table is None:
            table = self._block_tables[request.request_id] = []
            self._num_handled_blocks[request.request_id] = 0
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit_tokens
                self.host_hit_tokens += num_host_tokens
        # Touch before allocating, so the allocation cannot evict the hit it is extending;
        # likewise the host hit is pinned until the step's copies are taken, or the host slots
        # that this allocation's evictions reserve could reuse its slots.
        self.block_pool.touch(new_computed_blocks)
        for slot in host_hit_slots:
            self.host_pool.pin(slot)
            self._load_pins.append(slot)
        table.extend(new_computed_blocks)
        self._num_handled_blocks[request.request_id] += len(new_computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        table.extend(new_blocks)
        # The host hit's blocks come first among the new ones (they follow the device hit);
        # they are hashed by `cache_full_blocks` after the step, once loaded.
        self._transfers.loads.extend(zip(host_hit_slots, new_blocks))
        self._offload_evicted()
        return new_blocks

    def swap_out(self, request: Request) -> int:
        """Gives a running request's full computed blocks host copies before it is preempted,
        pinned until `release_swapped`; call it before `free`.

        Blocks whose hash the host already holds are pinned without a copy; the others get a
        slot and a planned offload. It stops at the first block the host has no room for (the
        rest is recomputed, as the partial last block always is).

        Returns:
            The blocks now held on the host for the request (0 without a host tier).
        """
        if self.host_pool is None:
            return 0
        table = self._block_tables.get(request.request_id, [])
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_computed // self.block_size, len(table))
        hashes = self._request_block_hashes(request, num_full)
        pinned = self._swapped.setdefault(request.request_id, [])
        num_before = len(pinned)
        for block_id, block_hash in zip(table, hashes[:num_full]):
            slot = self.host_pool.slot_of(block_hash)
            if slot is None:
                slot = self.host_pool.reserve(block_hash)
                if slot is None:
                    break
                self._transfers.offloads.append((block_id, slot))
            self.host_pool.pin(slot)
            pinned.append(slot)
        self.num_swapped_blocks += len(pinned) - num_before
        return len(pinned) - num_before

    def release_swapped(self, request_id: str) -> None:
        """Drops the pins `swap_out` took for the request (on readmission or when it ends)."""
        for slot in self._swapped.pop(request_id, ()):
            self.host_pool.unpin(slot)

    def take_transfers(self) -> KVTransfers:
        """Returns and forgets the copies planned since the last call (see the module
        docstring for the order they must be issued in)."""
        self._offload_evicted()
        for slot in self._load_pins:
            self.host_pool.unpin(slot)  # the caller reads the loads before reserving again
        self._load_pins = []
        transfers, self._transfers = self._transfers, KVTransfers()
        return transfers

    def _offload_evicted(self) -> None:
        """Gives each block the device pool evicted a host slot and plans its copy."""
        if self.host_pool is None:
            return
        for block_id, block_hash in self.block_pool.take_evicted():
            slot = self.host_pool.reserve(block_hash)
            if slot is not None:
                self._transfers.offloads.append((block_id, slot))

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's full, computed blocks in the prefix cache.

        Call it after the step that computed the tokens has run (the scheduler does so in
        `update_from_output`), so that a cached block always holds its keys and values.
        Blocks handled before are skipped; a block whose hash another block already holds
        stays uncached.
        """
        if not self.enable_prefix_caching:
            return
        table = self._block_tables.get(request.request_id)
        if not table:
            return
        # Accepted drafts are computed before they are appended as tokens, so the computed
        # count can run ahead of the known tokens, which the hashes are made of.
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_computed // self.block_size, len(table))
        first = self._num_handled_blocks[request.request_id]
        if num_full <= first:
            return
        hashes = self._request_block_hashes(request, num_full)
        for index in range(first, num_full):
            self.block_pool.cache_block(table[index], hashes[index])
        self._num_handled_blocks[request.request_id] = num_full

    def free_excess_blocks(self, request: TokenSequence) -> int:
        """Rolls a request's table back to its computed tokens, by length, without copies.

        After a speculative step, the tokens of rejected drafts stay in the pages as garbage
        past `num_computed_tokens` (later steps overwrite them); the blocks that hold only such
        tokens go back to the free list. They were never cached: `cache_full_blocks` only
        registers computed blocks, and the scheduler rolls back before calling it.

        Returns:
            The number of blocks released.
        """
        table = self._block_tables.get(request.request_id)
        if not table:
            return 0
        num_needed = -(-request.num_computed_tokens // self.block_size)
        excess = table[num_needed:]
        del table[num_needed:]
        self._num_handled_blocks[request.request_id] = min(
            self._num_handled_blocks[request.request_id], num_needed)
        self.block_pool.free(reversed(excess))
        return len(excess)

    def free(self, request: TokenSequence) -> None:
        """Releases the request's blocks, last first, and forgets its hashes.

        Cached blocks stay in the prefix cache (evictable) once no table holds them. Freeing a
        request that holds no blocks does nothing.
        """
        table = self._block_tables.pop(request.request_id, [])
        self._block_hashes.pop(request.request_id, None)
        self._num_handled_blocks.pop(request.request_id, None)
        self.block_pool.free(reversed(table))

    def _request_block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Returns the request's hash chain, extended to at least `num_blocks` full blocks."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        num_blocks = min(num_blocks, request.num_tokens // self.block_size)
        tokens = request.all_token_ids
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = request.cache_salt if index == 0 else None
            block_tokens = tokens[index * self.block_size:(index + 1) * self.block_size]
            hashes.append(hash_block(parent, block_tokens, extra))
        return hashes
