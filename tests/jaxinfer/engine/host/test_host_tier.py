"""The host KV tier through the KV cache manager and the scheduler, with the test_scheduler fake
model, which reads and writes token ids in its pages: here it also carries out the planned
copies (an evicted page to a host slot before the step, a host slot back into a fresh block),
through the HostBlockPool's real buffers. A copy of the wrong page, a load into the wrong
block, a host slot reused while still needed or a swap that loses tokens change the sampled
tokens, which must equal the reference loop's."""

import random

import numpy as np
import pytest

from jaxinfer.engine.config import CacheConfig, SchedulerConfig
from jaxinfer.engine.host.host_block_pool import HostBlockPool
from jaxinfer.engine.host.kv_cache_manager import KVCacheManager
from jaxinfer.engine.host.request import Request
from jaxinfer.engine.host.scheduler import Scheduler
from tests.jaxinfer.engine.host.test_scheduler import (
    VOCAB,
    PagedFakeModel,
    check_invariants,
    reference_outputs,
)

BLOCK = 4
MAX_MODEL_LEN = 64


class TieredFakeModel(PagedFakeModel):
    """The fake model plus the host tier's copies, done as the device side does them: offloads
    read the pages before the step writes, land in host memory at `collect`, loads before the
    step."""

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.host = scheduler.kv_cache_manager.host_pool
        self.in_flight = []
        self.num_loaded = 0

    def collect(self):
        for slots, pages in self.in_flight:
            self.host.write(slots, [np.asarray(pages, np.int64)])
            self.host.commit(slots)
        self.in_flight = []

    def execute(self, scheduler_output):
        transfers = scheduler_output.kv_transfers
        if transfers.offloads:
            pages = [[-1 if token is None else token for token in self.pages[block]]
                     for block, _ in transfers.offloads]
            self.in_flight.append(([slot for _, slot in transfers.offloads], pages))
        if transfers.loads:
            rows = self.host.read([slot for slot, _ in transfers.loads])[0]  # [n, BLOCK]
            for (_, block), row in zip(transfers.loads, rows):
                self.pages[block] = [None if token < 0 else int(token) for token in row]
            self.num_loaded += len(transfers.loads)
        return super().execute(scheduler_output)


def make_tiered(num_blocks, host_blocks, preemption_mode="recompute", **scheduler_fields):
    fields = dict(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    fields.update(scheduler_fields)
    cache = CacheConfig(page_size=BLOCK, num_pages=num_blocks, kv_offload_bytes=1,
                        preemption_mode=preemption_mode)
    host = HostBlockPool(host_blocks, [((BLOCK,), np.int64)])
    return Scheduler(SchedulerConfig(**fields), cache, host)


def run(scheduler, model, requests, abort_at=None):
    """Adds the requests and steps until all end; `abort_at` {step: [ids]} aborts on the way.
    Returns the requests' outputs and the tokens the steps computed."""
    for request in requests:
        scheduler.add_request(request)
    computed, step = 0, 0
    while scheduler.has_unfinished_requests():
        assert step < 5000, "no progress"
        for request_id in (abort_at or {}).get(step, ()):
            scheduler.abort_request(request_id)
        model.collect()
        output = scheduler.schedule()
        check_invariants(scheduler, output)
        computed += output.num_scheduled_tokens
        scheduler.update_from_output(output, model.execute(output))
        step += 1
    model.collect()
    return {request.request_id: list(request.output_token_ids) for request in requests}, computed


def conversations(rng, count, turns, system):
    """Each conversation's turns: its history so far plus a few new tokens each time."""
    histories = [list(system) + [rng.randrange(VOCAB) for _ in range(6)] for _ in range(count)]
    waves = []
    for turn in range(turns):
        wave = []
        for index, history in enumerate(histories):
            history += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
            wave.append(Request(f"c{index}t{turn}", list(history), max_tokens=3))
        waves.append(wave)
    return waves


def assert_back_to_full(scheduler):
    manager = scheduler.kv_cache_manager
    assert manager.block_pool.num_free_blocks == manager.block_pool.capacity
    host = manager.host_pool
    assert host.num_pending_blocks == 0 and host.num_pinned_blocks == 0
    assert host.num_free_blocks == host.num_blocks


def test_evicted_prefixes_come_back_from_host_and_outputs_match():
    rng = random.Random(0)
    waves = conversations(rng, count=6, turns=3, system=[rng.randrange(VOCAB) for _ in range(12)])
    results = {}
    computed = {}
    for tier in (False, True):
        scheduler = make_tiered(num_blocks=24, host_blocks=200)
        if not tier:
            scheduler = Scheduler(scheduler.config, CacheConfig(page_size=BLOCK, num_pages=24))
            model = PagedFakeModel(scheduler)
            model.collect = lambda: None
        else:
            model = TieredFakeModel(scheduler)
        total = 0
        for wave in waves:
            fresh = [Request(request.request_id, request.prompt_token_ids, max_tokens=3)
                     for request in wave]
            outputs, spent = run(scheduler, model, fresh)
            results.setdefault(tier, {}).update(outputs)
            total += spent
        computed[tier] = total
        if tier:
            manager = scheduler.kv_cache_manager
            assert model.num_loaded > 0 and manager.host_hit_tokens == model.num_loaded * BLOCK
            assert manager.host_pool.num_hits == model.num_loaded
            assert_back_to_full(scheduler)
    for wave in waves:
        for request in wave:
            expected, _ = reference_outputs(request.prompt_token_ids, 3, MAX_MODEL_LEN)
            assert results[True][request.request_id] == expected
            assert results[False][request.request_id] == expected
    assert computed[True] < computed[False]  # host hits were not recomputed


def test_full_host_tier_evicts_least_recent_and_stays_correct():
    rng = random.Random(1)
    waves = conversations(rng, count=5, turns=3, system=[rng.randrange(VOCAB) for _ in range(8)])
    scheduler = make_tiered(num_blocks=20, host_blocks=3)
    model = TieredFakeModel(scheduler)
    for wave in waves:
        outputs, _ = run(scheduler, model, wave)
        for request in wave:
            expected, _ = reference_outputs(request.prompt_token_ids, 3, MAX_MODEL_LEN)
            assert outputs[request.request_id] == expected
    assert scheduler.kv_cache_manager.host_pool.num_evictions > 0
    assert_back_to_full(scheduler)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_host_tier_matches_reference(mode):
    rng = random.Random(2)
    requests = [Request(f"r{index}", [rng.randrange(VOCAB) for _ in range(rng.randint(10, 30))],
                        max_tokens=rng.randint(10, 30)) for index in range(10)]
    scheduler = make_tiered(num_blocks=26, host_blocks=400, preemption_mode=mode)
    model = TieredFakeModel(scheduler)
    outputs, _ = run(scheduler, model, requests)
    for request in requests:
        expected, _ = reference_outputs(request.prompt_token_ids, request.max_tokens,
                                        MAX_MODEL_LEN)
        assert outputs[request.request_id] == expected
    manager = scheduler.kv_cache_manager
    assert sum(request.num_preemptions for request in requests) > 0
    if mode == "swap":
        assert manager.num_swapped_blocks > 0
    assert manager.host_hit_tokens > 0  # the preempted requests' blocks came back
    assert_back_to_full(scheduler)


def test_swap_pins_until_readmission_and_aborts_release_everything():
    rng = random.Random(3)
    requests = [Request(f"r{index}", [rng.randrange(VOCAB) for _ in range(24)], max_tokens=30)
                for index in range(8)]
    scheduler = make_tiered(num_blocks=26, host_blocks=400, preemption_mode="swap")
    model = TieredFakeModel(scheduler)
    for request in requests:
        scheduler.add_request(request)
    host = scheduler.kv_cache_manager.host_pool
    pinned_seen = False
    for _ in range(200):
        model.collect()
        output = scheduler.schedule()
        scheduler.update_from_output(output, model.execute(output))
        swapped = [request for request in scheduler.waiting if request.num_preemptions]
        if swapped and host.num_pinned_blocks:
            pinned_seen = True
            # Abort one swapped request while it waits and one running request.
            scheduler.abort_request(swapped[0].request_id)
            scheduler.abort_request(scheduler.running[0].request_id)
            break
    assert pinned_seen
    for request in list(scheduler.waiting) + list(scheduler.running):
        scheduler.abort_request(request.request_id)
    model.collect()
    assert not scheduler.has_unfinished_requests()
    assert_back_to_full(scheduler)


def test_manager_plans_offloads_for_evictions_and_loads_for_host_hits():
    host = HostBlockPool(8, [((BLOCK,), np.int64)])
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK, host_pool=host)  # 4 usable
    first = Request("a", list(range(13)))  # 3 full blocks + 1 token
    assert manager.allocate_slots(first, 12) is not None
    first.num_computed_tokens = 12
    manager.cache_full_blocks(first)
    table = manager.get_block_table("a")
    manager.free(first)
    assert not manager.take_transfers()
    second = Request("b", [99] * 16)
    assert manager.allocate_slots(second, 16) is not None  # the free block, then 3 evictions
    transfers = manager.take_transfers()
    # Freed last block first, so evicted in that order.
    assert [block for block, _ in transfers.offloads] == table[::-1]
    assert not transfers.loads and host.num_pending_blocks == 3
    host.commit([slot for _, slot in transfers.offloads])
    manager.free(second)
    again = Request("c", list(range(13)))
    blocks, _ = manager.get_computed_blocks(again)
    assert blocks == []  # gone from the device
    slots = manager.get_host_hits(again, 0)
    assert len(slots) == 3
    new = manager.allocate_slots(again, 1, host_hit_slots=slots)
    assert len(new) == 4
    transfers = manager.take_transfers()
    assert transfers.loads == list(zip(slots, new[:3]))
    assert manager.host_hit_tokens == 12
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(again, 0, host_hit_slots=slots)


def test_host_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager(4, BLOCK, enable_prefix_caching=False,
                       host_pool=HostBlockPool(2, [((BLOCK,), np.int64)]))
