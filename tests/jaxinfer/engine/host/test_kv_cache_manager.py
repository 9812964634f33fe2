"""Tests of KVCacheManager: block tables, hash chains and prefix-cache sharing."""

import pytest

from jaxinfer.engine.host.kv_cache_manager import KVCacheManager, hash_block
from jaxinfer.engine.host.request import Request

BLOCK_SIZE = 4


def _request(request_id, tokens, **kwargs):
    return Request(request_id, tokens, max_tokens=8, **kwargs)


def _admit_and_compute(manager, request):
    """Admits the request through the prefix cache and marks its whole prompt as computed."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_blocks)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return hit_blocks, num_hit_tokens


def test_hash_block_is_deterministic_and_chained():
    root = hash_block(None, [1, 2, 3, 4])
    assert root == hash_block(None, (1, 2, 3, 4))
    assert len(root) == 32
    assert root != hash_block(None, [4, 3, 2, 1])
    child = hash_block(root, [5, 6, 7, 8])
    assert child != hash_block(None, [5, 6, 7, 8])
    assert child != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], extra="salt") != root
    assert hash_block(None, [1, 2, 3, 4], extra="salt") == hash_block(None, [1, 2, 3, 4], "salt")


def test_allocation_grows_by_whole_blocks_only_when_needed():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = _request("a", range(6))
    assert len(manager.allocate_slots(request, 6)) == 2
    request.num_computed_tokens = 6
    for _ in range(2):  # Tokens 7 and 8 still fit in the second block.
        request.append_output_token(0)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    request.append_output_token(0)
    assert len(manager.allocate_slots(request, 1)) == 1
    assert len(manager.get_block_table("a")) == 3
    assert manager.num_free_blocks == 9 - 3


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)  # 3 usable blocks.
    holder = _request("holder", range(8))
    manager.allocate_slots(holder, 8)
    request = _request("b", range(9))
    assert manager.allocate_slots(request, 9) is None
    assert manager.get_block_table("b") == []
    assert manager.num_free_blocks == 1
    assert manager.allocate_slots(request, 4) is not None


def test_allocating_past_the_known_tokens_raises():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="only 3 are known"):
        manager.allocate_slots(_request("a", range(3)), 4)


def test_prefix_hit_is_shared_by_reference_and_never_rewritten():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = _request("a", range(10))
    _admit_and_compute(manager, first)
    first_table = manager.get_block_table("a")
    pool = manager.block_pool
    assert pool.num_cached_blocks == 2  # Two full blocks; the partial third is not cached.

    second = _request("b", [*range(8), 50, 51, 52])
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert hit_blocks == first_table[:2]
    assert num_hit_tokens == 8
    new_blocks = manager.allocate_slots(second, 3, hit_blocks)
    second_table = manager.get_block_table("b")
    assert second_table[:2] == first_table[:2]
    # The new tokens go to a fresh block, never into the shared ones.
    assert set(new_blocks).isdisjoint(first_table)
    assert [pool.ref_count(block_id) for block_id in hit_blocks] == [2, 2]

    manager.free(first)
    assert [pool.ref_count(block_id) for block_id in hit_blocks] == [1, 1]
    assert not any(pool.is_evictable(block_id) for block_id in hit_blocks)
    manager.free(second)
    assert all(pool.is_evictable(block_id) for block_id in hit_blocks)
    assert manager.num_free_blocks == pool.capacity


def test_partial_block_prefix_is_not_shared():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _admit_and_compute(manager, _request("a", range(10)))
    # Shares 6 tokens with "a": one full block plus half of one, and only the full one is hit.
    assert manager.get_computed_blocks(_request("b", [*range(6), 99, 98, 97]))[1] == 4
    # Shares 3 tokens: not even one full block.
    assert manager.get_computed_blocks(_request("c", [0, 1, 2, 99, 98]))[1] == 0


def test_last_prompt_token_is_always_recomputed():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _admit_and_compute(manager, _request("a", range(12)))
    assert manager.block_pool.num_cached_blocks == 3
    # The same 8-token prefix as a whole prompt: the second block holds the last token.
    blocks, num_hit_tokens = manager.get_computed_blocks(_request("b", range(8)))
    assert (len(blocks), num_hit_tokens) == (1, 4)
    # The whole 12-token prompt again: 8 tokens hit, the last block is recomputed.
    assert manager.get_computed_blocks(_request("c", range(12)))[1] == 8
    assert manager.get_computed_blocks(_request("d", range(13)))[1] == 12


def test_identical_blocks_computed_side_by_side_are_registered_once():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    first, second = _request("a", range(9)), _request("b", range(9))
    # Both admitted before either is computed, so neither can hit the other.
    for request in (first, second):
        hit_blocks, _ = manager.get_computed_blocks(request)
        assert hit_blocks == []
        manager.allocate_slots(request, 9)
    for request in (first, second):
        request.num_computed_tokens = 9
        manager.cache_full_blocks(request)
    pool = manager.block_pool
    first_table, second_table = manager.get_block_table("a"), manager.get_block_table("b")
    assert pool.num_cached_blocks == 2
    assert all(pool.block_hash(block_id) is not None for block_id in first_table[:2])
    assert all(pool.block_hash(block_id) is None for block_id in second_table)
    manager.free(second)
    assert pool.num_evictable_blocks == 0  # The duplicates went straight to the free list.
    assert manager.get_computed_blocks(_request("c", range(9)))[0] == first_table[:2]


def test_free_releases_the_tail_first_so_it_is_evicted_first():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)  # 3 usable blocks.
    request = _request("a", range(13))
    manager.allocate_slots(request, 12)
    request.num_computed_tokens = 12
    manager.cache_full_blocks(request)
    table = manager.get_block_table("a")
    manager.free(request)
    assert manager.block_pool.num_evictable_blocks == 3
    other = _request("b", [77] * 4)
    assert manager.allocate_slots(other, 4) == [table[2]]
    # The head of the prefix survives the eviction of its tail.
    assert manager.get_computed_blocks(_request("c", range(13)))[0] == table[:2]


def test_hit_chain_stops_at_the_first_missing_block():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    tokens = list(range(13))
    chain = [hash_block(None, tokens[:4], None)]
    for index in (1, 2):
        chain.append(hash_block(chain[-1], tokens[4 * index:4 * index + 4]))
    # Blocks 1 and 2 of the prefix are cached, block 0 is not (as if it had been evicted).
    pool = manager.block_pool
    for block_id, block_hash in zip(pool.allocate(2), chain[1:]):
        pool.cache_block(block_id, block_hash)
    assert manager.get_computed_blocks(_request("a", tokens)) == ([], 0)
    (head,) = pool.allocate(1)
    pool.cache_block(head, chain[0])
    blocks, num_hit_tokens = manager.get_computed_blocks(_request("b", tokens))
    assert blocks[0] == head
    assert num_hit_tokens == 12


def test_evictable_hit_blocks_are_not_counted_as_room_for_new_blocks():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable blocks.
    first = _request("a", range(9))
    _admit_and_compute(manager, first)
    manager.free(first)
    pool = manager.block_pool
    assert (pool.num_evictable_blocks, pool.num_free_blocks) == (2, 4)
    # Hits 2 evictable blocks and needs 3 more: only 2 truly free blocks remain.
    second = _request("b", [*range(8), *range(50, 59)])
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert manager.allocate_slots(second, 9, hit_blocks) is None
    assert pool.num_evictions == 0
    assert all(pool.is_evictable(block_id) for block_id in hit_blocks)
    # Needing 2 more fits, and the hit blocks are kept, not evicted to make room.
    assert manager.allocate_slots(second, 8, hit_blocks) is not None
    assert manager.get_block_table("b")[:2] == hit_blocks
    assert pool.num_evictions == 0
    assert pool.num_free_blocks == 0


def test_cache_salt_isolates_prefixes():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _admit_and_compute(manager, _request("a", range(9), cache_salt="tenant-1"))
    assert manager.get_computed_blocks(_request("b", range(9), cache_salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(_request("c", range(9)))[1] == 0
    assert manager.get_computed_blocks(_request("d", range(9), cache_salt="tenant-1"))[1] == 8


def test_disabled_prefix_caching_neither_caches_nor_hits():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = _request("a", range(9))
    _admit_and_compute(manager, first)
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(_request("b", range(9))) == ([], 0)
    manager.free(first)
    assert manager.block_pool.num_evictable_blocks == 0


def test_usage_and_hit_rate():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)  # 10 usable blocks.
    assert (manager.usage, manager.prefix_cache_hit_rate) == (0.0, 0.0)
    first = _request("a", range(10))
    _admit_and_compute(manager, first)
    assert manager.usage == pytest.approx(0.3)
    _admit_and_compute(manager, _request("b", range(10)))
    assert manager.prefix_cache_queries == 20
    assert manager.prefix_cache_hits == 8
    assert manager.prefix_cache_hit_rate == pytest.approx(0.4)
    assert manager.usage == pytest.approx(0.4)  # One new block; two are shared.


def test_computed_blocks_are_accepted_on_admission_only():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _admit_and_compute(manager, _request("a", range(9)))
    second = _request("b", range(9))
    hit_blocks, _ = manager.get_computed_blocks(second)
    manager.allocate_slots(second, 1, hit_blocks)
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(second, 0, hit_blocks)
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.get_computed_blocks(second)
