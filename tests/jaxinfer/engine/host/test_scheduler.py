"""Tests of the Scheduler, driven by a fake model that really reads and writes paged KV slots.

The fake model writes every fed token into the slot its block table names and samples the next
token from the context it reads back out of those slots. So a wrong block table, a prefix hit on
the wrong block, a cached block written twice, or a preemption that forgets tokens all change
the sampled tokens, which are checked against a plain reference loop.
"""

import ast
import pathlib
import random
import subprocess
import sys

import pytest

import jaxinfer.engine
from jaxinfer.engine.config import CacheConfig, SchedulerConfig, SchedulerConfigError
from jaxinfer.engine.host.block_pool import NULL_BLOCK_ID
from jaxinfer.engine.host.draft import Draft
from jaxinfer.engine.host.request import Request, RequestStatus
from jaxinfer.engine.host.scheduler import Scheduler

VOCAB = 97
ENGINE_DIR = pathlib.Path(jaxinfer.engine.__file__).parent
HOST_MODULES = ("__init__", "config", "errors", "limits", "host/__init__", "host/block_pool",
                "host/draft", "host/host_block_pool", "host/kv_cache_manager", "host/request",
                "host/scheduler")


def next_token(context):
    """The fake model: a position-weighted checksum, so order and content both matter."""
    return sum((position + 1) * token for position, token in enumerate(context)) % VOCAB


def reference_outputs(prompt, max_tokens, max_model_len, eos_token_ids=(), ignore_eos=False):
    """What a request must produce: the fake model run one token at a time, no scheduler."""
    context = list(prompt)
    outputs = []
    while True:
        token = next_token(context)
        context.append(token)
        outputs.append(token)
        if not ignore_eos and token in eos_token_ids:
            return outputs, RequestStatus.FINISHED_STOPPED
        if len(outputs) >= max_tokens or len(context) >= max_model_len:
            return outputs, RequestStatus.FINISHED_LENGTH


class PagedFakeModel:
    """Runs SchedulerOutputs against a simulated paged KV cache holding token ids."""

    def __init__(self, scheduler):
        self.pool = scheduler.kv_cache_manager.block_pool
        self.block_size = scheduler.cache.page_size
        self.pages = {}

    def execute(self, scheduler_output):
        sampled = {}
        for scheduled in scheduler_output.scheduled_requests:
            for token, position in zip(scheduled.token_ids, scheduled.positions, strict=True):
                block_id = scheduled.block_table[position // self.block_size]
                assert block_id != NULL_BLOCK_ID
                # Cached blocks are immutable: a write into one would corrupt every sharer.
                assert self.pool.block_hash(block_id) is None, f"wrote cached block {block_id}"
                page = self.pages.setdefault(block_id, [None] * self.block_size)
                page[position % self.block_size] = token
            if scheduled.needs_sample:
                context = [self.pages[scheduled.block_table[position // self.block_size]]
                           [position % self.block_size]
                           for position in range(scheduled.context_length)]
                assert None not in context, "read a slot that was never written"
                sampled[scheduled.request_id] = [next_token(context)]
        return sampled


def make_scheduler(**overrides):
    fields = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_blocks=200,
                  max_model_len=64)
    fields.update(overrides)
    return Scheduler(*split_config(**fields))


def split_config(*, block_size, num_blocks, enable_prefix_caching=True, **scheduler_fields):
    """The scheduler's two configs from the flat fields these tests use."""
    return (SchedulerConfig(**scheduler_fields),
            CacheConfig(page_size=block_size, num_pages=num_blocks,
                        enable_prefix_caching=enable_prefix_caching))


def check_invariants(scheduler, scheduler_output):
    """Bookkeeping that must hold after every schedule()."""
    config = scheduler.config
    scheduled_ids = [scheduled.request_id for scheduled in scheduler_output.scheduled_requests]
    assert len(scheduled_ids) == len(set(scheduled_ids))
    assert scheduler_output.num_scheduled_tokens == sum(
        scheduled.num_tokens for scheduled in scheduler_output.scheduled_requests)
    assert scheduler_output.num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    waiting_ids = [request.request_id for request in scheduler.waiting]
    running_ids = [request.request_id for request in scheduler.running]
    assert len(set(waiting_ids) | set(running_ids)) == len(waiting_ids) + len(running_ids)
    assert len(waiting_ids) + len(running_ids) == scheduler.num_unfinished_requests
    assert set(scheduled_ids) <= set(running_ids)
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    for request in scheduler.waiting:
        assert manager.get_block_table(request.request_id) == []
        assert request.num_computed_tokens == 0
    references = [0] * pool.num_blocks
    for request in scheduler.running:
        table = manager.get_block_table(request.request_id)
        assert len(table) == -(-request.num_computed_tokens // scheduler.cache.page_size)
        for block_id in table:
            references[block_id] += 1
    assert all(references[block_id] == pool.ref_count(block_id)
               for block_id in range(1, pool.num_blocks))
    held = sum(1 for count in references if count)
    assert pool.num_free_blocks + held == pool.capacity


def run_step(scheduler, model):
    scheduler_output = scheduler.schedule()
    check_invariants(scheduler, scheduler_output)
    return scheduler_output, scheduler.update_from_output(
        scheduler_output, model.execute(scheduler_output))


def run_to_completion(scheduler, requests, model=None, max_steps=10_000):
    """Adds the requests, steps until all finish, returns {id: (outputs, status)} and the steps.

    Pass the same `model` to successive calls on one scheduler: its pages are the KV cache
    that the scheduler's prefix cache refers to.
    """
    model = model or PagedFakeModel(scheduler)
    for request in requests:
        scheduler.add_request(request)
    results = {}
    steps = []
    while scheduler.has_unfinished_requests():
        assert len(steps) < max_steps, "the scheduler stopped making progress"
        scheduler_output, request_outputs = run_step(scheduler, model)
        steps.append(scheduler_output)
        for request_output in request_outputs:
            if request_output.finished:
                assert request_output.request_id not in results
                results[request_output.request_id] = request_output.status
    outputs = {request.request_id: (request.output_token_ids, results[request.request_id])
               for request in requests}
    return outputs, steps


def random_requests(rng, count, max_model_len, vocab=VOCAB, prefixes=()):
    requests = []
    for index in range(count):
        prompt = list(rng.choice(prefixes)) if prefixes and rng.random() < 0.5 else []
        prompt += [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        prompt = prompt[:max_model_len - 2]
        max_tokens = rng.randint(1, max_model_len - len(prompt))
        requests.append(Request(f"r{index}", prompt, max_tokens=max_tokens))
    return requests


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize(("field", "value"), [
    ("max_num_batched_tokens", 0),
    ("max_num_seqs", -1),
    ("block_size", 2.5),
    ("num_blocks", True),
    ("max_model_len", 1),
    ("enable_prefix_caching", "yes"),
    ("max_num_batched_tokens", 4),  # Below max_num_seqs = 8.
    ("num_blocks", 16),  # A 64-token sequence needs 16 blocks of 4, plus the null block.
])
def test_config_names_the_bad_field(field, value):
    fields = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_blocks=17,
                  max_model_len=64)
    Scheduler(*split_config(**fields))
    fields[field] = value
    # The pool's fields keep the engine's names (page_size, num_pages) in messages.
    named = {"block_size": "page_size", "num_blocks": "num_pages"}.get(field, field)
    with pytest.raises(SchedulerConfigError, match=repr(named)):
        Scheduler(*split_config(**fields))


def test_add_request_rejects_reused_ids_and_prompts_without_room():
    scheduler = make_scheduler(max_model_len=16, num_blocks=10)
    scheduler.add_request(Request("a", [1, 2], max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("a", [3], max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(Request("b", list(range(16)), max_tokens=2))
    with pytest.raises(ValueError, match="at least one token"):
        Request("c", [], max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("d", [1], max_tokens=0)


# ---------------------------------------------------------------------- the token budget


def test_long_prompt_is_prefilled_in_chunks_of_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    prompt = [(7 * index) % VOCAB for index in range(50)]
    outputs, steps = run_to_completion(scheduler, [Request("long", prompt, max_tokens=5)])
    chunks = [step.scheduled_requests[0] for step in steps]
    assert [chunk.num_tokens for chunk in chunks] == [16, 16, 16, 2, 1, 1, 1, 1]
    assert [chunk.needs_sample for chunk in chunks] == [False, False, False] + [True] * 5
    assert [chunk.positions[0] for chunk in chunks] == [0, 16, 32, 48, 50, 51, 52, 53]
    for chunk in chunks:
        assert chunk.positions == list(range(chunk.positions[0], chunk.context_length))
    assert outputs["long"] == reference_outputs(prompt, 5, 64)


def test_running_requests_come_first_and_newcomers_get_the_rest_of_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4)
    model = PagedFakeModel(scheduler)
    scheduler.add_request(Request("old", [1, 2, 3], max_tokens=20))
    run_step(scheduler, model)
    scheduler.add_request(Request("new", list(range(30)), max_tokens=2))
    scheduler_output, _ = run_step(scheduler, model)
    shares = [(s.request_id, s.num_tokens) for s in scheduler_output.scheduled_requests]
    assert shares == [("old", 1), ("new", 9)]
    scheduler_output, _ = run_step(scheduler, model)
    shares = [(s.request_id, s.num_tokens) for s in scheduler_output.scheduled_requests]
    assert shares == [("old", 1), ("new", 9)]


def test_max_num_seqs_caps_the_running_set_and_admission_is_fifo():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=32)
    requests = [Request(f"r{index}", [index + 1] * 3, max_tokens=4) for index in range(5)]
    outputs, steps = run_to_completion(scheduler, requests)
    assert max(len(step.scheduled_requests) for step in steps) == 2
    first_scheduled = []
    for step in steps:
        for scheduled in step.scheduled_requests:
            if scheduled.request_id not in first_scheduled:
                first_scheduled.append(scheduled.request_id)
    assert first_scheduled == [request.request_id for request in requests]
    for request in requests:
        assert outputs[request.request_id] == reference_outputs(request.prompt_token_ids, 4, 64)


# ---------------------------------------------------------------------- preemption


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_with_a_tiny_pool_recomputes_without_losing_anything(enable_prefix_caching):
    rng = random.Random(1234)
    max_model_len = 32
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 12))] for _ in range(6)]

    def run(num_blocks):
        requests = [Request(f"r{index}", prompt, max_tokens=max_model_len - len(prompt))
                    for index, prompt in enumerate(prompts)]
        scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=6, block_size=4,
                                   num_blocks=num_blocks, max_model_len=max_model_len,
                                   enable_prefix_caching=enable_prefix_caching)
        outputs, steps = run_to_completion(scheduler, requests)
        pool = scheduler.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.capacity
        num_preempted = sum(len(step.preempted_request_ids) for step in steps)
        return outputs, num_preempted, requests

    tiny, tiny_preemptions, requests = run(num_blocks=9)  # Room for one full sequence only.
    huge, huge_preemptions, _ = run(num_blocks=400)
    assert tiny_preemptions > 0
    assert huge_preemptions == 0
    assert tiny == huge
    for request in requests:
        outputs, status = tiny[request.request_id]
        assert len(outputs) == request.max_tokens
        assert status is RequestStatus.FINISHED_LENGTH
        assert (outputs, status) == reference_outputs(request.prompt_token_ids,
                                                      request.max_tokens, max_model_len)
    assert sum(request.num_preemptions for request in requests) == tiny_preemptions


def test_the_newest_running_request_is_preempted_to_the_front_of_the_queue():
    # 4 usable blocks of 4 tokens: two requests of 7 prompt tokens fill them after one decode.
    scheduler = make_scheduler(max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
                               num_blocks=5, max_model_len=16)
    model = PagedFakeModel(scheduler)
    older = Request("older", [1] * 7, max_tokens=8)
    newer = Request("newer", [2] * 7, max_tokens=8)
    queued = Request("queued", [3] * 3, max_tokens=1)
    for request in (older, newer, queued):
        scheduler.add_request(request)
    run_step(scheduler, model)  # Both prefill (2 blocks each) and sample; "queued" must wait.
    assert [request.request_id for request in scheduler.running] == ["older", "newer"]
    run_step(scheduler, model)  # Token 8 of each still fits in its second block.
    scheduler_output, _ = run_step(scheduler, model)  # Token 9 of "older" needs a third block.
    assert scheduler_output.preempted_request_ids == ["newer"]
    assert [s.request_id for s in scheduler_output.scheduled_requests] == ["older"]
    assert newer.status is RequestStatus.PREEMPTED
    assert newer.num_computed_tokens == 0
    assert newer.num_output_tokens == 2  # Its sampled tokens are kept.
    assert [request.request_id for request in scheduler.waiting] == ["newer", "queued"]
    assert scheduler.kv_cache_manager.get_block_table("newer") == []


# ---------------------------------------------------------------------- prefix caching


def test_a_prefix_hit_skips_the_cached_tokens():
    scheduler = make_scheduler()
    model = PagedFakeModel(scheduler)
    prompt = list(range(1, 11))
    run_to_completion(scheduler, [Request("first", prompt, max_tokens=3)], model)
    second = Request("second", prompt, max_tokens=3)
    outputs, steps = run_to_completion(scheduler, [second], model)
    first_chunk = steps[0].scheduled_requests[0]
    assert first_chunk.positions[0] == 8
    assert first_chunk.token_ids == prompt[8:]
    assert second.num_cached_tokens == 8
    assert outputs["second"] == reference_outputs(prompt, 3, 64)
    assert scheduler.kv_cache_manager.prefix_cache_hits == 8


def test_whole_prompt_hit_still_recomputes_the_last_token():
    scheduler = make_scheduler()
    model = PagedFakeModel(scheduler)
    prompt = list(range(1, 9))  # Exactly two blocks.
    run_to_completion(scheduler, [Request("first", prompt, max_tokens=2)], model)
    outputs, steps = run_to_completion(scheduler, [Request("second", prompt, max_tokens=2)],
                                       model)
    first_chunk = steps[0].scheduled_requests[0]
    assert first_chunk.positions == [4, 5, 6, 7]
    assert first_chunk.needs_sample
    assert outputs["second"] == reference_outputs(prompt, 2, 64)


# ---------------------------------------------------------------------- stopping


def test_eos_stops_unless_ignored():
    prompt = [5, 6, 7]
    first_token = next_token(prompt)
    scheduler = make_scheduler()
    outputs, _ = run_to_completion(scheduler, [
        Request("stops", prompt, max_tokens=10, eos_token_ids=(first_token,)),
        Request("ignores", prompt, max_tokens=10, eos_token_ids=(first_token,), ignore_eos=True),
    ])
    assert outputs["stops"] == ([first_token], RequestStatus.FINISHED_STOPPED)
    assert outputs["ignores"] == reference_outputs(prompt, 10, 64)
    assert len(outputs["ignores"][0]) == 10


def test_max_model_len_ends_the_request_with_length():
    scheduler = make_scheduler(max_model_len=12, num_blocks=10)
    outputs, _ = run_to_completion(scheduler, [Request("a", list(range(9)), max_tokens=100)])
    tokens, status = outputs["a"]
    assert len(tokens) == 3
    assert status is RequestStatus.FINISHED_LENGTH
    assert status.finish_reason == "length"


# ---------------------------------------------------------------------- aborts


def _pool_is_full(scheduler):
    pool = scheduler.kv_cache_manager.block_pool
    return pool.num_free_blocks == pool.capacity


def test_abort_frees_pages_in_prefill_in_decode_and_while_waiting():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    model = PagedFakeModel(scheduler)
    prefilling = Request("prefilling", list(range(30)), max_tokens=4)
    decoding = Request("decoding", [1, 2, 3], max_tokens=50)
    waiting = Request("waiting", [4, 5], max_tokens=4)
    scheduler.add_request(decoding)
    run_step(scheduler, model)
    scheduler.add_request(prefilling)
    scheduler.add_request(waiting)
    run_step(scheduler, model)
    assert prefilling.status is RequestStatus.RUNNING
    assert 0 < prefilling.num_computed_tokens < prefilling.num_tokens
    assert decoding.num_output_tokens == 2
    assert waiting.status is RequestStatus.WAITING

    assert scheduler.abort_request("prefilling")
    assert scheduler.kv_cache_manager.get_block_table("prefilling") == []
    assert scheduler.abort_request("waiting")
    assert scheduler.abort_request("decoding")
    assert not scheduler.abort_request("decoding")
    assert not scheduler.abort_request("never-added")
    for request in (prefilling, waiting, decoding):
        assert request.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests()
    assert _pool_is_full(scheduler)
    assert sorted(scheduler.schedule().finished_request_ids) == [
        "decoding", "prefilling", "waiting"]


def test_abort_requests_takes_many_at_once_running_and_waiting():
    # The n samples of one request are aborted in one pass over the queues (one by one it was
    # O(n^2) in deque.remove); the requests left keep their order.
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=4)
    model = PagedFakeModel(scheduler)
    requests = [Request(f"r{i}", [1 + i, 2, 3], max_tokens=8) for i in range(10)]
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler, model)
    assert [r.request_id for r in scheduler.running] == ["r0", "r1", "r2", "r3"]
    gone = ["r1", "r3", "r4", "r8", "r8", "never-added"]
    assert scheduler.abort_requests(gone) == ["r1", "r3", "r4", "r8"]
    assert [r.request_id for r in scheduler.running] == ["r0", "r2"]
    assert [r.request_id for r in scheduler.waiting] == ["r5", "r6", "r7", "r9"]
    assert all(requests[i].status is RequestStatus.FINISHED_ABORTED for i in (1, 3, 4, 8))
    assert scheduler.abort_requests([]) == []
    run_to_completion(scheduler, [], model)  # the same pages
    for i in (0, 2, 5, 6, 7, 9):
        assert requests[i].status is RequestStatus.FINISHED_LENGTH
        assert len(requests[i].output_token_ids) == 8
    assert _pool_is_full(scheduler)


def test_abort_between_schedule_and_update_drops_the_late_tokens():
    scheduler = make_scheduler()
    model = PagedFakeModel(scheduler)
    scheduler.add_request(Request("a", [1, 2, 3], max_tokens=5))
    scheduler.add_request(Request("b", [4, 5, 6], max_tokens=5))
    scheduler_output = scheduler.schedule()
    sampled = model.execute(scheduler_output)
    assert scheduler.abort_request("a")
    reused = Request("a", [9, 9], max_tokens=5)  # A new request reusing the id.
    scheduler.add_request(reused)
    request_outputs = scheduler.update_from_output(scheduler_output, sampled)
    assert [output.request_id for output in request_outputs] == ["b"]
    assert reused.output_token_ids == []
    assert reused.status is RequestStatus.WAITING
    assert scheduler.abort_request("a")
    assert scheduler.abort_request("b")
    assert _pool_is_full(scheduler)


# ---------------------------------------------------------------------- misuse


def test_update_checks_which_requests_sample():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    scheduler.add_request(Request("a", list(range(20)), max_tokens=2))
    scheduler_output = scheduler.schedule()
    assert not scheduler_output.scheduled_requests[0].needs_sample
    with pytest.raises(ValueError, match="not scheduled to sample"):
        scheduler.update_from_output(scheduler_output, {"a": [1]})
    with pytest.raises(ValueError, match="not scheduled to sample"):
        scheduler.update_from_output(scheduler_output, {"stranger": [1]})
    with pytest.raises(RuntimeError, match="before update_from_output"):
        scheduler.schedule()
    assert scheduler.update_from_output(scheduler_output, {}) == []
    with pytest.raises(RuntimeError, match="not the one awaiting"):
        scheduler.update_from_output(scheduler_output, {})
    scheduler.update_from_output(scheduler.schedule(), {})  # The second 8-token chunk.
    scheduler_output = scheduler.schedule()  # The last 4 prompt tokens.
    assert scheduler_output.scheduled_requests[0].needs_sample
    with pytest.raises(ValueError, match="needs a sampled token"):
        scheduler.update_from_output(scheduler_output, {})
    (request_output,) = scheduler.update_from_output(scheduler_output, {"a": [42]})
    assert request_output.new_token_ids == [42]
    assert not request_output.finished


def test_several_sampled_tokens_stop_at_the_first_stop():
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1, 2], max_tokens=10, eos_token_ids=(0,)))
    scheduler_output = scheduler.schedule()
    (request_output,) = scheduler.update_from_output(scheduler_output, {"a": [5, 0, 6]})
    assert request_output.new_token_ids == [5, 0]
    assert request_output.finish_reason == "stop"
    assert _pool_is_full(scheduler)


# ---------------------------------------------------------------------- stress


@pytest.mark.parametrize(("seed", "enable_prefix_caching"),
                         [(0, True), (1, True), (2, False), (3, True)])
def test_random_arrivals_lengths_and_aborts_lose_nothing(seed, enable_prefix_caching):
    rng = random.Random(seed)
    max_model_len = 40
    scheduler = make_scheduler(max_num_batched_tokens=rng.choice([8, 16, 24]), max_num_seqs=6,
                               block_size=rng.choice([2, 4, 8]), num_blocks=26,
                               max_model_len=max_model_len,
                               enable_prefix_caching=enable_prefix_caching)
    model = PagedFakeModel(scheduler)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    pending = random_requests(rng, 60, max_model_len, prefixes=prefixes)
    for request in pending:
        request.eos_token_ids = (rng.randrange(VOCAB),) if rng.random() < 0.3 else ()
    added, finished, aborted = {}, {}, set()

    def abort_one():
        unfinished = [request_id for request_id in added
                      if request_id not in finished and request_id not in aborted]
        if unfinished:
            request_id = rng.choice(unfinished)
            assert scheduler.abort_request(request_id)
            aborted.add(request_id)

    steps = 0
    while pending or scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 5000, "the scheduler stopped making progress"
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                request = pending.pop(0)
                added[request.request_id] = request
                scheduler.add_request(request)
        if rng.random() < 0.05:
            abort_one()
        scheduler_output = scheduler.schedule()
        check_invariants(scheduler, scheduler_output)
        sampled = model.execute(scheduler_output)
        if rng.random() < 0.05:
            abort_one()  # Between the step and its update.
        for request_output in scheduler.update_from_output(scheduler_output, sampled):
            if request_output.finished:
                assert request_output.request_id not in finished
                assert request_output.request_id not in aborted
                finished[request_output.request_id] = request_output.status

    assert set(finished) | aborted == set(added)
    assert not set(finished) & aborted
    assert len(added) == 60
    assert aborted, "the test should exercise aborts"
    for request_id, status in finished.items():
        request = added[request_id]
        expected = reference_outputs(request.prompt_token_ids, request.max_tokens,
                                     max_model_len, request.eos_token_ids)
        assert (request.output_token_ids, status) == expected
    for request_id in aborted:
        request = added[request_id]
        expected, _ = reference_outputs(request.prompt_token_ids, request.max_tokens,
                                        max_model_len, request.eos_token_ids)
        assert request.output_token_ids == expected[:request.num_output_tokens]
        assert request.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.waiting and not scheduler.running
    assert _pool_is_full(scheduler)


# ---------------------------------------------------------------------- speculative decoding


def verify_like_a_target(model, scheduler_output):
    """Runs the step on the paged fake model and verifies drafts greedily: the fake model's
    token at each fed position (read back from the pages) is compared with the next draft."""
    sampled = model.execute(scheduler_output)
    for scheduled in scheduler_output.scheduled_requests:
        drafts = scheduled.spec_token_ids
        if not drafts:
            continue
        first = scheduled.context_length - len(drafts) - 1  # the last known token's position
        emitted = []
        for index in range(len(drafts) + 1):
            context = [model.pages[scheduled.block_table[position // model.block_size]]
                       [position % model.block_size] for position in range(first + index + 1)]
            token = next_token(context)
            emitted.append(token)
            if index == len(drafts) or drafts[index] != token:
                break
        sampled[scheduled.request_id] = emitted
    return sampled


@pytest.mark.parametrize(("seed", "enable_prefix_caching"), [(0, True), (1, False), (2, True)])
def test_speculative_drafts_roll_back_and_lose_nothing(seed, enable_prefix_caching):
    """Drafts that are partly right, a small pool (preemption) and aborts: every request still
    gets the reference output, rejected drafts never land in a cached block (the fake model
    asserts), tables shrink back after rejections, and no page leaks."""
    rng = random.Random(seed)
    max_model_len = 40
    scheduler = make_scheduler(max_num_batched_tokens=rng.choice([8, 16]), max_num_seqs=5,
                               block_size=rng.choice([2, 4]), num_blocks=30,
                               max_model_len=max_model_len,
                               enable_prefix_caching=enable_prefix_caching)
    model = PagedFakeModel(scheduler)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(2)]
    pending = random_requests(rng, 40, max_model_len, prefixes=prefixes)
    added, aborted = {}, set()
    drafted = accepted = 0
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 5000, "the scheduler stopped making progress"
        if pending and rng.random() < 0.5:
            request = pending.pop(0)
            added[request.request_id] = request
            scheduler.add_request(request)
        if rng.random() < 0.03 and scheduler.running:
            victim = rng.choice(scheduler.running).request_id
            assert scheduler.abort_request(victim)
            aborted.add(victim)
        proposed = {}
        for request in scheduler.running:
            # The true continuation, with each draft corrupted 30% of the time.
            context, drafts = list(request.all_token_ids), []
            for _ in range(rng.randint(0, 4)):
                token = next_token(context)
                context.append(token)
                drafts.append(token if rng.random() < 0.7 else (token + 1) % VOCAB)
            proposed[request.request_id] = Draft(drafts)
        scheduler_output = scheduler.schedule(proposed)
        check_invariants(scheduler, scheduler_output)
        for scheduled in scheduler_output.scheduled_requests:
            assert scheduled.token_ids[len(scheduled.token_ids) - len(scheduled.spec_token_ids):] \
                == scheduled.spec_token_ids
        sampled = verify_like_a_target(model, scheduler_output)
        for output in scheduler.update_from_output(scheduler_output, sampled):
            drafted += output.num_draft_tokens
            accepted += output.num_accepted_tokens
        # After the rollback, each table covers exactly the computed tokens again.
        for request in scheduler.running:
            table = scheduler.kv_cache_manager.get_block_table(request.request_id)
            assert len(table) == -(-request.num_computed_tokens // scheduler.cache.page_size)
    assert 0 < accepted < drafted
    for request_id, request in added.items():
        expected, _ = reference_outputs(request.prompt_token_ids, request.max_tokens,
                                        max_model_len, request.eos_token_ids)
        if request_id in aborted:
            assert request.output_token_ids == expected[:request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
            assert request.num_output_tokens <= request.max_tokens
    assert _pool_is_full(scheduler)


def _step(scheduler, token=5, drafts=None):
    """One step in which every request that needs a sample gets `token` (drafts rejected)."""
    output = scheduler.schedule(drafts)
    scheduler.update_from_output(output, {scheduled.request_id: [token] for scheduled in
                                          output.scheduled_requests if scheduled.needs_sample})
    return output


def test_drafts_are_trimmed_by_budget_max_tokens_and_length():
    scheduler = make_scheduler(max_num_batched_tokens=4, max_num_seqs=2, block_size=4,
                               max_model_len=12)
    short = Request("short", [1, 2, 3], max_tokens=3)
    scheduler.add_request(short)
    _step(scheduler)
    output = scheduler.schedule({"short": Draft([6, 7, 8, 9])})
    (scheduled,) = output.scheduled_requests
    # max_tokens 3 with one output: at most 2 more tokens, so 1 draft (+ 1 token).
    assert scheduled.spec_token_ids == [6] and scheduled.token_ids == [5, 6]
    assert scheduled.positions == [3, 4] and scheduled.needs_sample
    (result,) = scheduler.update_from_output(output, {"short": [6, 4]})
    assert result.finished and result.new_token_ids == [6, 4] and result.num_accepted_tokens == 1
    assert _pool_is_full(scheduler)

    near_end = Request("long", list(range(1, 11)), max_tokens=10)  # max_model_len 12
    other = Request("other", [1], max_tokens=10)
    scheduler.add_request(near_end)
    scheduler.add_request(other)
    while near_end.num_output_tokens == 0 or other.num_output_tokens == 0:
        _step(scheduler)
    drafts = {"long": Draft([6, 7, 8]), "other": Draft([6, 7, 8])}
    by_id = {scheduled.request_id: scheduled
             for scheduled in _step(scheduler, drafts=drafts).scheduled_requests}
    # 11 tokens known, max_model_len 12: no room for a draft (it would emit 2 tokens).
    assert by_id["long"].spec_token_ids == []
    # The budget of 4 has 3 left after "long"'s one token: "other" gets 1 + 2 drafts.
    assert by_id["other"].spec_token_ids == [6, 7]
    # All rejected: back to one computed token short of the known ones, pages trimmed.
    assert other.num_computed_tokens == other.num_tokens - 1
    assert len(scheduler.kv_cache_manager.get_block_table("other")) == 1
    # Drafts are for one step: the next one, given none, feeds none.
    assert all(not scheduled.spec_token_ids for scheduled in _step(scheduler).scheduled_requests)


def test_drafts_only_for_running_requests():
    scheduler = make_scheduler()
    scheduler.add_request(Request("waiting", [1, 2], max_tokens=3))
    with pytest.raises(ValueError, match="not running"):
        scheduler.schedule({"waiting": Draft([3])})
    assert not scheduler.running and len(scheduler.waiting) == 1  # nothing changed


# ---------------------------------------------------------------------- no jax


def _imported_modules(path):
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            names.append(node.module)
    return names


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_modules_import_no_jax(module):
    # Statically, including imports inside functions; project imports must stay among the host
    # modules checked here, so that the check covers everything they pull in.
    # jaxinfer.kv_formats (the KV dtypes' names and byte formulas) imports nothing at all,
    # checked below, so it brings no jax in.
    allowed_project = {"jaxinfer.engine.host", "jaxinfer.config", "jaxinfer.kv_formats"} | {
        f"jaxinfer.engine.{name.replace('/', '.')}" for name in HOST_MODULES
        if not name.endswith("__init__")}
    for name in _imported_modules(ENGINE_DIR / f"{module}.py"):
        top = name.split(".")[0]
        assert top not in {"jax", "jaxlib", "flax", "optax", "orbax"}, f"{module}: {name}"
        if top == "jaxinfer":
            assert name in allowed_project, f"{module} imports {name}"


def test_kv_formats_imports_nothing():
    path = ENGINE_DIR.parent / "kv_formats.py"
    assert set(_imported_modules(path)) <= {"__future__"}, _imported_modules(path)


def test_importing_the_engine_package_loads_no_jax():
    # jaxinfer/__init__.py is not ours to keep jax-free, so the subprocess stands in an empty
    # package for it and imports the engine package (and through it every host module).
    code = (
        "import sys, types\n"
        f"package = types.ModuleType('jaxinfer'); package.__path__ = [{str(ENGINE_DIR.parent)!r}]\n"
        "sys.modules['jaxinfer'] = package\n"
        "import jaxinfer.engine, jaxinfer.engine.host.scheduler\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
