"""Tests of BlockPool: allocation, ref counts, the prefix-cache LRU and its eviction order."""

import pytest

from jaxinfer.engine.host.block_pool import NULL_BLOCK_ID, BlockPool, NoFreeBlocksError


def test_null_block_is_reserved_and_never_allocated():
    pool = BlockPool(5)
    assert pool.capacity == 4
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in blocks
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="null block"):
        pool.free([NULL_BLOCK_ID])


def test_too_few_blocks_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert [pool.ref_count(block_id) for block_id in held] == [1, 1]
    assert pool.allocate(0) == []


def test_free_returns_blocks_and_double_free_raises():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert pool.num_free_blocks == 3
    assert all(pool.ref_count(block_id) == 0 for block_id in blocks)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([blocks[0]])


def test_touch_counts_references_and_the_block_stays_until_the_last_free():
    pool = BlockPool(3)
    (block_id,) = pool.allocate(1)
    assert pool.cache_block(block_id, "h")
    pool.touch([block_id])
    assert pool.ref_count(block_id) == 2
    pool.free([block_id])
    assert pool.ref_count(block_id) == 1
    assert not pool.is_evictable(block_id)
    assert pool.num_free_blocks == 1
    pool.free([block_id])
    assert pool.is_evictable(block_id)
    assert pool.num_free_blocks == 2


def test_touch_of_a_free_uncached_block_raises():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="is free"):
        pool.touch([1])


def test_freed_cached_block_stays_findable_and_uncached_block_does_not():
    pool = BlockPool(4)
    cached, plain = pool.allocate(2)
    pool.cache_block(cached, "prefix")
    pool.free([cached, plain])
    assert pool.lookup("prefix") == cached
    assert pool.block_hash(cached) == "prefix"
    assert pool.is_evictable(cached)
    assert not pool.is_evictable(plain)
    assert pool.block_hash(plain) is None
    assert pool.num_free_blocks == 3
    assert pool.num_cached_blocks == 1


def test_cached_blocks_are_evicted_only_when_the_free_list_is_empty():
    pool = BlockPool(6)
    cached = pool.allocate(2)
    for index, block_id in enumerate(cached):
        pool.cache_block(block_id, f"h{index}")
    pool.free(cached)
    # Three free blocks remain besides the two cached ones: all three come first.
    fresh = pool.allocate(3)
    assert set(fresh).isdisjoint(cached)
    assert pool.num_evictions == 0
    assert pool.lookup("h0") == cached[0]
    assert pool.lookup("h1") == cached[1]


def test_eviction_is_least_recently_freed_first_and_drops_the_hash():
    pool = BlockPool(4)
    first, second, third = pool.allocate(3)
    for block_id, block_hash in ((first, "a"), (second, "b"), (third, "c")):
        pool.cache_block(block_id, block_hash)
    # Freed in the order third, first, second: that is the eviction order.
    pool.free([third])
    pool.free([first])
    pool.free([second])
    assert pool.allocate(1) == [third]
    assert pool.lookup("c") is None
    assert pool.block_hash(third) is None
    assert pool.allocate(1) == [first]
    assert pool.lookup("a") is None
    assert pool.lookup("b") == second
    assert pool.num_evictions == 2


def test_touched_block_leaves_the_lru_and_is_not_evicted():
    pool = BlockPool(3)
    older, newer = pool.allocate(2)
    pool.cache_block(older, "old")
    pool.cache_block(newer, "new")
    pool.free([older, newer])
    pool.touch([older])  # A prefix hit on the least recently used block.
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [newer]
    assert pool.lookup("old") == older
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_a_hash_is_registered_once_and_the_first_block_keeps_it():
    pool = BlockPool(4)
    first, duplicate = pool.allocate(2)
    assert pool.cache_block(first, "same")
    assert not pool.cache_block(duplicate, "same")
    assert pool.lookup("same") == first
    assert pool.block_hash(duplicate) is None
    assert pool.cache_block(first, "same")  # Idempotent.
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(first, "other")
    pool.free([duplicate])
    assert not pool.is_evictable(duplicate)


def test_only_in_use_blocks_can_be_cached():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_block(1, "h")


def test_lookup_counts_queries_and_hits():
    pool = BlockPool(3)
    (block_id,) = pool.allocate(1)
    pool.cache_block(block_id, "h")
    pool.lookup("h")
    pool.lookup("missing")
    pool.lookup("h")
    assert (pool.num_lookups, pool.num_lookup_hits) == (3, 2)


def test_out_of_range_ids_are_rejected():
    pool = BlockPool(3)
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="out of range"):
            pool.ref_count(bad)
