"""The roofline floor's arithmetic, worked by hand on the tiny preset."""

from __future__ import annotations

import pytest

from jaxinfer.bench.roofline import (
    Peaks,
    StepCost,
    layer_matmul_parameters,
    step_cost,
    workload_cost,
)
from jaxinfer.config import get_preset


def test_layer_parameters_and_step_cost_by_hand():
    config = get_preset("tiny")
    d, h, f = config.hidden_size, config.head_dim, config.intermediate_size
    n, k, v, layers = config.num_heads, config.num_kv_heads, config.vocab_size, config.num_layers
    per_layer = d * h * (2 * n + 2 * k) + 3 * d * f
    assert layer_matmul_parameters(config) == per_layer
    # 4 decode tokens, each over 10 keys.
    cost = step_cost(config, 4, 4, 40, 40)
    assert cost.flops == 2 * per_layer * layers * 4 + 2 * d * v * 4 + 4 * n * h * 40 * layers
    kv_token = 2 * k * h * layers * 4  # float32
    assert cost.bytes == (per_layer * layers + d * v) * 4 + 40 * kv_token + 4 * kv_token


def test_the_floor_adds_compute_and_memory_time():
    peaks = Peaks(matmul_flops=1e11, read_bytes=1e10, dtype="float32")
    assert StepCost(2e9, 5e8).floor_seconds(peaks) == pytest.approx(0.02 + 0.05)


def test_workload_floor_is_its_prefill_plus_every_decode_wave():
    config = get_preset("tiny")
    # Two prompts of 3 and 5 tokens, 3 output tokens, one sequence per decode step: the
    # prefill, then two waves of two decode steps each.
    total = workload_cost(config, [3, 5], 3, 1)
    parts = [step_cost(config, 8, 2, 3 * 4 // 2 + 5 * 6 // 2, 0),
             step_cost(config, 1, 1, 4, 3), step_cost(config, 1, 1, 5, 4),
             step_cost(config, 1, 1, 6, 5), step_cost(config, 1, 1, 7, 6)]
    assert total.flops == sum(part.flops for part in parts)
    assert total.bytes == sum(part.bytes for part in parts)
    # Batching both sequences reads the weights once per step instead of twice.
    assert workload_cost(config, [3, 5], 3, 2).bytes < total.bytes


def test_decode_profiles_time_every_sequence_of_the_batch():
    # A small step budget prefills the batch over several steps while the first sequences
    # already decode: none may finish (or wait) before the timed decode steps.
    from jaxinfer.bench.roofline import profile_engine
    from jaxinfer.bench.throughput import build_engine, load_bench_model
    from jaxinfer.engine.host.scheduler import Scheduler

    engine = build_engine(load_bench_model("random:tiny"),
                          {"max_num_seqs": 8, "max_num_batched_tokens": 64}, 160)
    running = []
    original = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        running.append(len(self.running))
        return out

    Scheduler.schedule = schedule
    try:
        profiles = profile_engine(engine, context=48, decode_steps=4, batches=(8,))
    finally:
        Scheduler.schedule = original
    decode = profiles[-1]
    assert decode.name == "decode@8" and decode.num_tokens == 8
    assert running[-4:] == [8, 8, 8, 8]  # the timed steps ran the whole batch
    assert decode.context >= 48 + 4 // 2
