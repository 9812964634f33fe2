"""Roofline accounting for the engine benchmarks: how far each kind of step is from its floor.

The machine's two peaks are measured in the same process as the steps they bound, because the
CPUs behind this project's machines change from day to day (60 to 300 GFLOP/s):
- the matmul rate: a 2048 x 2048 x 2048 matmul in the model's compute dtype;
- the read bandwidth: a sum over a 256 MiB float32 array (well past every cache).

A step's floor is FLOPs / rate + bytes / bandwidth, with
- FLOPs: 2 x (the layers' matmul parameters) per fed token, 2 x D x V per sampled row
  (the LM head runs on the rows that sample only), and 4 x N x H per (query, visible key) pair
  of attention (scores and weighted values), per layer;
- bytes: every weight the step reads once (the layers, and the LM head) plus the KV cache it
  reads (each visible key and value once) and writes.

`profile_engine` then runs an engine through controlled steps and times them: one full
prefill step, and decode steps at batch 1, 16 and 64 over contexts of a fixed length. It also
splits each step's wall time into host work (drafting, scheduling, packing the inputs, output
processing) and device time (the jitted step until its results are back on the host), from the
engine's own counters.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.core import Engine

DECODE_BATCHES = (1, 16, 64)


@dataclasses.dataclass(frozen=True)
class Peaks:
    """The machine's measured peaks.

    Attributes:
        matmul_flops: FLOP/s of a large square matmul in the compute dtype.
        read_bytes: Bytes/s of a large reduction.
        dtype: The compute dtype the matmul ran in.
    """

    matmul_flops: float
    read_bytes: float
    dtype: str


def _best_seconds(function, *arguments, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls, after one compiling call."""
    import jax

    jax.block_until_ready(function(*arguments))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(function(*arguments))
        times.append(time.perf_counter() - started)
    return min(times)


def measure_peaks(dtype: str = "float32") -> Peaks:
    """Measures the matmul rate (in `dtype`) and the read bandwidth of this machine now."""
    import jax
    import jax.numpy as jnp

    size = 2048
    matrix = jnp.ones((size, size), dtype)  # [2048, 2048]
    seconds = _best_seconds(jax.jit(jnp.matmul), matrix, matrix)
    flat = jnp.ones((64 * 1024 * 1024,), jnp.float32)  # [2^26]: 256 MiB
    read = _best_seconds(jax.jit(jnp.sum), flat)
    return Peaks(2 * size ** 3 / seconds, flat.nbytes / read, dtype)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes a step must do and move at least."""

    flops: float
    bytes: float

    def floor_seconds(self, peaks: Peaks) -> float:
        """FLOPs / matmul rate + bytes / read bandwidth."""
        return self.flops / peaks.matmul_flops + self.bytes / peaks.read_bytes


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}[dtype]


def layer_matmul_parameters(config: ModelConfig) -> int:
    """Matmul parameters of one decoder block a token passes through (MoE: its top-k
    experts)."""
    d, h = config.hidden_size, config.head_dim
    attention = d * h * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o, k, v
    experts = config.num_experts_per_token if config.is_moe else 1
    router = d * config.num_experts if config.is_moe else 0
    return attention + experts * 3 * d * config.intermediate_size + router


def step_cost(config: ModelConfig, num_tokens: int, num_sampled: int,
              visible_keys: int, kv_read_tokens: int, *, kv_dtype: str | None = None
              ) -> StepCost:
    """The floor's FLOPs and bytes of one step.

    Args:
        config: The model.
        num_tokens: Tokens fed through the layers.
        num_sampled: Rows that go through the LM head.
        visible_keys: Sum over fed tokens of the keys each one attends to.
        kv_read_tokens: Cached tokens whose keys and values the step reads (each once).
        kv_dtype: The KV pages' dtype (default: the compute dtype).
    """
    weight_bytes = _dtype_bytes(config.param_dtype)
    layers = config.num_layers
    per_layer = layer_matmul_parameters(config)
    head = config.hidden_size * config.vocab_size
    # HARP blocks (config.num_harp_layers) have no q/k projections, QK^T or KV cache.
    attention_layers = config.num_cache_layers
    block_parameters = per_layer * layers - config.num_harp_layers * config.hidden_size * (
        config.head_dim * (config.num_heads + config.num_kv_heads))
    flops = (2 * block_parameters * num_tokens + 2 * head * num_sampled
             + 4 * config.num_heads * config.head_dim * visible_keys * attention_layers)
    kv_token = 2 * config.num_kv_heads * config.head_dim * attention_layers * _dtype_bytes(
        kv_dtype or config.dtype)
    read = (block_parameters + head) * weight_bytes + kv_read_tokens * kv_token
    written = num_tokens * kv_token
    return StepCost(flops, read + written)


def workload_cost(config: ModelConfig, prompt_lens: Sequence[int], output_len: int,
                  max_num_seqs: int, *, kv_dtype: str | None = None) -> StepCost:
    """The floor's FLOPs and bytes of serving a whole batch workload, every request greedy.

    The schedule is the cheapest one the roofline allows: every prompt is computed once (the
    weights read once for all of them, each prompt attending causally to itself; it samples
    its first output token), then the requests decode `output_len - 1` tokens in waves of at
    most `max_num_seqs`, each wave's step reading the weights once and every running
    sequence's cached keys and values once. Host time, padding and chunk boundaries are all
    zero in this floor, so no engine reaches it; its throughput bounds every schedule's.

    Args:
        config: The model.
        prompt_lens: Each request's prompt length.
        output_len: Output tokens per request, the first of them sampled by the prefill.
        max_num_seqs: Sequences one decode step may run.
        kv_dtype: The KV pages' dtype (default: the compute dtype).
    """
    lens = list(prompt_lens)
    prefill = step_cost(config, sum(lens), len(lens), sum(n * (n + 1) // 2 for n in lens), 0,
                        kv_dtype=kv_dtype)
    flops, moved = prefill.flops, prefill.bytes
    for start in range(0, len(lens), max_num_seqs):
        wave = lens[start:start + max_num_seqs]
        for step in range(1, output_len):
            # Each sequence holds its prompt and `step` outputs; the newest is fed.
            keys = sum(n + step for n in wave)
            cost = step_cost(config, len(wave), len(wave), keys, keys - len(wave),
                             kv_dtype=kv_dtype)
            flops, moved = flops + cost.flops, moved + cost.bytes
    return StepCost(flops, moved)


@dataclasses.dataclass
class StepProfile:
    """One kind of step, timed.

    Attributes:
        name: "prefill" or "decode@B".
        num_tokens: Tokens fed per step.
        context: Keys each sequence holds before the step.
        seconds: Median wall seconds per step (`Engine.step`).
        host_seconds: Its host part (drafting, scheduling, packing, outputs).
        device_seconds: Its device part (the jitted step until results are on the host).
        cost: The floor's FLOPs and bytes.
    """

    name: str
    num_tokens: int
    context: int
    seconds: float
    host_seconds: float
    device_seconds: float
    cost: StepCost


def _timed_steps(engine: Engine, count: int) -> tuple[float, float, float]:
    """Median (wall, host, device) seconds of the next `count` engine steps."""
    walls, devices = [], []
    for _ in range(count):
        device_before = engine.runner.seconds["device"]
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
        devices.append(engine.runner.seconds["device"] - device_before)
    wall, device = statistics.median(walls), statistics.median(devices)
    return wall, wall - device, device


def _abort_all(engine: Engine, request_ids: Sequence[str]) -> None:
    for request_id in request_ids:
        engine.abort_request(request_id)


def profile_engine(engine: Engine, *, context: int = 256, decode_steps: int = 8,
                   batches: Sequence[int] = DECODE_BATCHES, tag: str = "roofline"
                   ) -> list[StepProfile]:
    """Times a full prefill step and decode steps at each batch size on an idle engine.

    Prompts are random token ids (seeded); prefix caching should be off (the benchmarks turn
    it off) so that every prompt is computed. Batches larger than the engine's
    `max_num_seqs`, and contexts that do not fit `max_model_len`, are skipped.

    Returns:
        One `StepProfile` for the prefill step, then one per decode batch.
    """
    import numpy as np

    from jaxinfer.engine.sampling_params import SamplingParams

    config = engine.model_config
    budget = engine.config.scheduler.max_num_batched_tokens
    max_seqs = engine.config.scheduler.max_num_seqs
    context = min(context, engine.config.max_model_len - decode_steps - 2)
    rng = np.random.default_rng(0)
    # Requests whose prompts are computed first decode while the later ones are prefilled
    # (continuous batching), so a request may not finish before the timed steps: with only
    # decode_steps + 2 tokens, the first ones did, and "decode@64" timed ~30 sequences.
    greedy = SamplingParams(temperature=0.0, max_tokens=engine.config.max_model_len - context,
                            ignore_eos=True)
    profiles = []

    def prompt(length: int) -> list[int]:
        return rng.integers(1, config.vocab_size, length).tolist()

    # Prefill: whole prompts that fill exactly one step's budget, first chunk only.
    per_prompt = min(context, budget)
    count = max(1, budget // per_prompt)
    runs = []
    for trial in range(3):
        ids = [f"{tag}-prefill-{trial}-{i}" for i in range(count)]
        for request_id in ids:
            engine.add_request(request_id, prompt(per_prompt), greedy)
        runs.append(_timed_steps(engine, 1))
        _abort_all(engine, ids)
    # The run with the median wall time, whole, so that host + device = wall.
    wall, host, device = sorted(runs)[len(runs) // 2]
    tokens = count * per_prompt
    profiles.append(StepProfile(
        "prefill", tokens, 0, wall, host, device,
        step_cost(config, tokens, count, count * per_prompt * (per_prompt + 1) // 2, 0,
                  kv_dtype=engine.config.cache.page_dtype)))
    for batch in batches:
        if batch > max_seqs:
            continue
        ids = [f"{tag}-decode{batch}-{i}" for i in range(batch)]
        for request_id in ids:
            engine.add_request(request_id, prompt(context), greedy)
        # Prefill them all, then one decode step so every sequence is decoding.
        while any(request.num_computed_tokens < request.num_tokens - 1
                  for request in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        engine.step()
        # Every sequence decodes in every timed step (none finished or waits).
        first = engine.scheduler.running[0].num_tokens
        longest = max(request.num_tokens for request in engine.scheduler.running)
        if (len(engine.scheduler.running) != batch
                or longest + decode_steps > engine.config.max_model_len):
            raise RuntimeError(f"decode@{batch}: {len(engine.scheduler.running)} sequences "
                               f"running (longest {longest} tokens) cannot be timed for "
                               f"{decode_steps} steps")
        wall, host, device = _timed_steps(engine, decode_steps)
        _abort_all(engine, ids)
        # The median step's context: the sequences prefilled first have decoded since.
        keys = (first + longest) // 2 + decode_steps // 2
        profiles.append(StepProfile(
            f"decode@{batch}", batch, keys, wall, host, device,
            step_cost(config, batch, batch, batch * keys, batch * keys,
                      kv_dtype=engine.config.cache.page_dtype)))
    return profiles


def roofline_table(profiles: Sequence[StepProfile], peaks: Peaks) -> str:
    """The profiles against their floors, as a markdown table with the peaks above it."""
    lines = [f"measured peaks in this process: {peaks.matmul_flops / 1e9:.0f} GFLOP/s "
             f"({peaks.dtype} 2048^3 matmul), {peaks.read_bytes / 1e9:.1f} GB/s (256 MiB "
             "reduction)", "",
             "| step | tokens | context | GFLOP | MB moved | floor ms | measured ms | "
             "measured / floor | host ms | device ms | GFLOP/s (% of matmul) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for profile in profiles:
        floor = profile.cost.floor_seconds(peaks)
        rate = profile.cost.flops / profile.device_seconds
        lines.append(
            f"| {profile.name} | {profile.num_tokens} | {profile.context} | "
            f"{profile.cost.flops / 1e9:.2f} | {profile.cost.bytes / 1e6:.0f} | "
            f"{1e3 * floor:.1f} | {1e3 * profile.seconds:.1f} | "
            f"{profile.seconds / floor:.2f}x | {1e3 * profile.host_seconds:.1f} | "
            f"{1e3 * profile.device_seconds:.1f} | {rate / 1e9:.0f} "
            f"({rate / peaks.matmul_flops:.0%}) |")
    return "\n".join(lines)


def roofline_json(profiles: Sequence[StepProfile], peaks: Peaks) -> dict[str, Any]:
    """The profiles and peaks as JSON-ready numbers."""
    return {"peaks": dataclasses.asdict(peaks),
            "steps": [{**dataclasses.asdict(profile),
                       "floor_s": profile.cost.floor_seconds(peaks)} for profile in profiles]}
