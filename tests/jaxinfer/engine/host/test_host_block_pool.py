"""Tests of HostBlockPool: slots pending then cached, the LRU when full, pins, buffer I/O."""

import numpy as np
import pytest

from jaxinfer.engine.host.host_block_pool import HostBlockPool, KVTransfers

SPECS = [((2, 3), np.float32), ((2,), np.int8)]  # one block of two buffers


def _blocks(values):
    """`[n, 2, 3]` and `[n, 2]` arrays whose block i is filled with values[i]."""
    values = np.asarray(values)
    return [np.broadcast_to(values[:, None, None], (len(values), 2, 3)).astype(np.float32),
            np.broadcast_to(values[:, None], (len(values), 2)).astype(np.int8)]


def _store(pool, block_hash, value):
    slot = pool.reserve(block_hash)
    pool.write([slot], _blocks([value]))
    pool.commit([slot])
    return slot


def test_buffers_are_preallocated_and_sized():
    pool = HostBlockPool(5, SPECS)
    assert [buffer.shape for buffer in pool.buffers] == [(5, 2, 3), (5, 2)]
    assert pool.block_bytes == 2 * 3 * 4 + 2
    assert HostBlockPool.blocks_for_bytes(100, pool.block_bytes) == 3
    assert HostBlockPool.blocks_for_bytes(10, pool.block_bytes) == 0
    assert pool.num_free_blocks == 5
    with pytest.raises(ValueError, match="num_blocks"):
        HostBlockPool(0, SPECS)


def test_pending_slot_is_not_found_until_committed():
    pool = HostBlockPool(3, SPECS)
    slot = pool.reserve(b"a")
    assert slot is not None and pool.num_pending_blocks == 1
    assert pool.lookup(b"a") is None  # its bytes are not here yet
    assert pool.reserve(b"a") is None  # already has a slot: nothing to copy
    pool.write([slot], _blocks([7]))
    pool.commit([slot])
    assert pool.lookup(b"a") == slot
    assert (pool.num_lookups, pool.num_hits, pool.num_stored) == (2, 1, 1)
    assert pool.hit_rate == 0.5
    read = pool.read([slot])
    np.testing.assert_array_equal(read[0], _blocks([7])[0])
    np.testing.assert_array_equal(read[1], _blocks([7])[1])
    read[0][...] = 0  # a copy: the slot keeps its bytes
    assert pool.buffers[0][slot].max() == 7


def test_lru_evicts_least_recently_used_when_full():
    pool = HostBlockPool(3, SPECS)
    slots = {name: _store(pool, name, value) for value, name in enumerate([b"a", b"b", b"c"])}
    assert pool.num_free_blocks == 3  # cached slots are evictable
    assert pool.lookup(b"a") == slots[b"a"]  # a becomes the most recent
    slot_d = pool.reserve(b"d")
    assert slot_d == slots[b"b"] and pool.num_evictions == 1
    assert not pool.contains(b"b") and pool.lookup(b"b") is None
    pool.abandon([slot_d])  # its copy never came
    assert not pool.contains(b"d") and pool.num_free_blocks == 3
    assert pool.reserve(b"e") == slot_d  # the free slot goes before any eviction


def test_pinned_and_pending_slots_are_never_evicted():
    pool = HostBlockPool(2, SPECS)
    slot_a = _store(pool, b"a", 1)
    pool.pin(slot_a)
    slot_b = pool.reserve(b"b")  # pending
    assert pool.num_free_blocks == 0 and pool.num_pinned_blocks == 1
    assert pool.reserve(b"c") is None  # nothing evictable: the block is dropped
    pool.commit([slot_b])
    assert pool.reserve(b"c") == slot_b  # b was evictable once committed
    pool.unpin(slot_a)
    assert pool.num_pinned_blocks == 0
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin(slot_a)
    assert pool.lookup(b"a") == slot_a


def test_writes_and_reads_are_checked():
    pool = HostBlockPool(2, SPECS)
    slot = _store(pool, b"a", 1)
    with pytest.raises(ValueError, match="not pending"):
        pool.write([slot], _blocks([2]))
    with pytest.raises(ValueError, match="not pending"):
        pool.commit([slot])
    other = pool.reserve(b"b")
    with pytest.raises(ValueError, match="holds no committed block"):
        pool.read([other])
    with pytest.raises(ValueError, match="do not fit"):
        pool.write([other], _blocks([1, 2]))


def test_transfers_are_falsy_when_empty():
    assert not KVTransfers()
    assert KVTransfers(offloads=[(1, 0)])
    assert KVTransfers(loads=[(0, 1)])
