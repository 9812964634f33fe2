"""`jaxinfer bench throughput`: offline throughput of the engine, optionally against HF.

All N requests are submitted at once and the engine runs until every one has produced exactly
its output tokens (greedy, `ignore_eos`), as `vllm bench throughput` does. Reported: requests/s,
output tokens/s, total tokens/s (prompt + output), the warm-up seconds (every step bucket
compiled before the clock starts), and the programs compiled during the timed run, which must
be 0. With `compare_hf` the same requests run through transformers `generate` in static batches
(`jaxinfer.bench.hf_peer`) and the report adds the engine/HF ratio of output tokens/s and how
many requests got token-identical outputs on both sides.

This module also holds what both benchmarks share: model loading, the engine config, the
two engine adapters (`submit`, `collect_finished`), machine facts and report writing.
Nothing here imports jax or torch at module level, so the CLI stays fast to start.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxinfer.bench import hf_peer, vllm_peer
from jaxinfer.bench.workload import (
    BenchRequest,
    max_sequence_len,
    total_output_tokens,
    total_prompt_tokens,
)
from jaxinfer.engine.config import BENCH_DEFAULTS, EngineConfig

if TYPE_CHECKING:
    from jaxinfer.engine.core import Engine
    from jaxinfer.engine.outputs import RequestOutput
    from jaxinfer.models import Transformer


def load_bench_model(model: str, **config_overrides: Any) -> Transformer:
    """Loads `--model` as `jaxinfer.model_loading.load_model` does.

    Args:
        model: An HF directory, a jaxinfer checkpoint, `builtin:NAME` or `random:PRESET`.
        **config_overrides: ModelConfig fields (None values are dropped). Size fields apply to
            `random:PRESET` only.

    Raises:
        ValueError: Size overrides for a model that has trained weights.
    """
    from jaxinfer.model_loading import load_model

    overrides = {name: value for name, value in config_overrides.items() if value is not None}
    sizes = sorted(set(overrides) - {"dtype", "param_dtype"})
    if sizes and not model.startswith("random:"):
        raise ValueError(f"size flags {sizes} only apply to random:PRESET models, not {model!r}")
    return load_model(model, **overrides)


def bench_engine_config(options: Mapping[str, Any] | None, max_model_len: int) -> EngineConfig:
    """The engine config a benchmark runs: `BENCH_DEFAULTS` under `options`, `max_model_len`
    rounded up to whole pages, and prompt logprobs off (they double warm-up).

    Args:
        options: Flat engine options (`EngineConfig.from_options` names), e.g. from
            `engine_options_from_args`; None takes `BENCH_DEFAULTS` alone.
        max_model_len: The workload's longest sequence.

    Raises:
        ValueError: An invalid option, or one the benchmark sets itself (`max_model_len`,
            `enable_prompt_logprobs`).
    """
    options = dict(options or {})
    fixed = sorted(set(options) & {"max_model_len", "enable_prompt_logprobs"})
    if fixed:
        raise ValueError(f"engine options {fixed} are set by the benchmark (max_model_len "
                         "from the workload; prompt logprobs off)")
    config = EngineConfig.from_options(**{**BENCH_DEFAULTS, **options})
    page_size = config.cache.page_size
    return config.replace(max_model_len=-(-max_model_len // page_size) * page_size,
                          enable_prompt_logprobs=False)


def build_engine(model: Transformer, options: Mapping[str, Any] | None,
                 max_model_len: int) -> Engine:
    """An engine sized for the workload (`bench_engine_config`), on the devices its parallel
    sizes ask for (a `DataParallelEngine` for several replicas)."""
    from jaxinfer.engine import factory

    return factory.build_engine(model, bench_engine_config(options, max_model_len))


def speculative_summary(engine: Engine) -> dict[str, float] | None:
    """The engine's speculative-decoding totals and rates, or None without speculation."""
    if engine.speculative is None:
        return None
    stats = engine.stats()
    steps = stats.num_spec_steps
    return {"num_spec_steps": steps, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.spec_acceptance_rate,
            "mean_accepted_length": stats.num_accepted_tokens / steps if steps else 0.0}


def speculative_line(result: dict[str, Any]) -> str:
    """One markdown line with the run's acceptance numbers (empty without speculation)."""
    spec = result.get("speculative")
    if not spec:
        return ""
    return (f"\n\nspeculative decoding: {spec['num_draft_tokens']} drafted, "
            f"{spec['num_accepted_tokens']} accepted (acceptance rate "
            f"{spec['acceptance_rate']:.2f}, mean accepted length "
            f"{spec['mean_accepted_length']:.2f} per verification step)")


# ---------------------------------------------------------------------- engine adapters
# The only two places that know the engine's request and output API.


def submit(engine: Engine, request: BenchRequest) -> None:
    """Queues one request: greedy, exactly `output_len` tokens, EOS ignored."""
    from jaxinfer.engine.sampling_params import SamplingParams

    engine.add_request(request.request_id, list(request.prompt_token_ids), SamplingParams(
        temperature=0.0, max_tokens=request.output_len, ignore_eos=True))


def collect_finished(outputs: Sequence[RequestOutput],
                     finished: dict[str, list[int]]) -> None:
    """Records the generated token ids of every request that finished in this step."""
    for output in outputs:
        if output.finished:
            finished[output.request_id] = list(output.outputs[0].token_ids)


# ---------------------------------------------------------------------- timed runs


@dataclasses.dataclass
class EngineRun:
    """What the engine did on a workload.

    Attributes:
        elapsed_s: Wall seconds from the first submission to the last token.
        token_ids: request_id -> its generated token ids.
        num_steps: Engine steps taken.
        compilations: Programs compiled during the run (0 after a complete warm-up).
    """

    elapsed_s: float
    token_ids: dict[str, list[int]]
    num_steps: int
    compilations: int


def run_engine(engine: Engine, requests: Sequence[BenchRequest]) -> EngineRun:
    """Submits every request at once and steps the engine until all have finished.

    Raises:
        AssertionError: A request finished with a different number of tokens than asked for.
    """
    compiled_before = engine.compilations
    steps_before = engine.num_steps
    token_ids: dict[str, list[int]] = {}
    started = time.perf_counter()
    for request in requests:
        submit(engine, request)
    while engine.has_unfinished_requests():
        collect_finished(engine.step(), token_ids)
    elapsed = time.perf_counter() - started
    check_lengths(requests, token_ids, "the engine")
    return EngineRun(elapsed, token_ids, engine.num_steps - steps_before,
                     engine.compilations - compiled_before)


def check_lengths(requests: Sequence[BenchRequest], token_ids: dict[str, list[int]],
                  who: str) -> None:
    """Raises AssertionError unless every request got exactly `output_len` tokens."""
    for request in requests:
        got = len(token_ids.get(request.request_id, ()))
        if got != request.output_len:
            raise AssertionError(f"{who} generated {got} tokens for {request.request_id!r}, "
                                 f"not {request.output_len}")


def rates(requests: Sequence[BenchRequest], elapsed_s: float) -> dict[str, float]:
    """requests/s, output tokens/s and total (prompt + output) tokens/s over `elapsed_s`."""
    output = total_output_tokens(requests)
    return {"elapsed_s": elapsed_s,
            "requests_per_s": len(requests) / elapsed_s,
            "output_tokens_per_s": output / elapsed_s,
            "total_tokens_per_s": (output + total_prompt_tokens(requests)) / elapsed_s}


def agreement(requests: Sequence[BenchRequest], ours: dict[str, list[int]],
              theirs: dict[str, list[int]]) -> float:
    """Fraction of requests whose generated tokens are identical on both sides."""
    same = sum(ours[request.request_id] == theirs[request.request_id] for request in requests)
    return same / len(requests)


def run_throughput(model: Transformer, requests: Sequence[BenchRequest],
                   options: Mapping[str, Any] | None = None, *, compare_hf: bool = False,
                   hf_batch_size: int = 16, hf_threads: int | None = None,
                   roofline: bool = True, compare_vllm: bool = False,
                   vllm_latency_tokens: int = 0) -> dict[str, Any]:
    """The throughput benchmark.

    Args:
        model: The model both sides run.
        requests: The workload.
        options: Flat engine options over `BENCH_DEFAULTS` (see `bench_engine_config`).
        compare_hf: Also run transformers on the same requests and weights.
        hf_batch_size: HF's static batch size.
        hf_threads: torch intra-op threads (None: torch's default).
        compare_vllm: Also run vLLM for CPU (`make vllm-env`) on the same requests and
            weights, with the engine's step sizes (`jaxinfer.bench.vllm_peer`).
        vllm_latency_tokens: With compare_vllm and >= 2, vLLM also times batch-1 decode over
            this many tokens in the same process ("batch_1_decode_ms_per_token").
        roofline: After the run, measure the machine's peaks and time a prefill step and
            decode steps at batch 1/16/64 against their floors (`jaxinfer.bench.roofline`).

    Returns:
        A JSON-ready dict: the workload, an "engine" section (rates, warm_up_s, compilations,
        num_steps, programs), with compare_hf an "hf" section, "engine_over_hf" (output
        tokens/s ratio) and "hf_token_agreement"; also "token_ids" per side (dropped from
        the JSON file by `write_json`).

    Raises:
        HFUnavailableError: compare_hf without torch/transformers (raised before any work).
    """
    hf_model = hf_peer.load_hf_peer(model, hf_threads) if compare_hf else None
    if compare_vllm:
        vllm_peer.vllm_python()  # fail now, not after the engine run
    engine = build_engine(model, options, max_sequence_len(requests))
    warm_up_s = engine.warm_up()
    run = run_engine(engine, requests)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "num_requests": len(requests),
        "prompt_tokens": total_prompt_tokens(requests),
        "output_tokens": total_output_tokens(requests),
        "engine_settings": engine.config.options(),
        "engine": {**rates(requests, run.elapsed_s), "warm_up_s": warm_up_s,
                   "compilations_during_run": run.compilations, "num_steps": run.num_steps,
                   "programs": engine.compilations},
        "speculative": speculative_summary(engine),
        "token_ids": {"engine": run.token_ids},
    }
    if compare_vllm:
        scheduler = engine.config.scheduler
        vllm_run = vllm_peer.run_vllm(
            model, requests, max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_model_len=engine.config.max_model_len, latency_tokens=vllm_latency_tokens)
        check_lengths(requests, vllm_run.token_ids, "vLLM")
        result["vllm"] = {**rates(requests, vllm_run.elapsed_s),
                          "warm_up_s": vllm_run.startup_s, "version": vllm_run.version}
        if vllm_run.decode_ms_per_token is not None:
            result["vllm"]["batch_1_decode_ms_per_token"] = vllm_run.decode_ms_per_token
        result["engine_over_vllm"] = (result["engine"]["output_tokens_per_s"]
                                      / result["vllm"]["output_tokens_per_s"])
        result["vllm_token_agreement"] = agreement(requests, run.token_ids,
                                                   vllm_run.token_ids)
        result["token_ids"]["vllm"] = vllm_run.token_ids
    # The step's parts ("grammars" is a part of "outputs", not a further one).
    total_seconds = sum(engine.seconds[part] for part in ("propose", "schedule", "execute",
                                                          "outputs"))
    if total_seconds > 0:
        host = total_seconds - engine.runner.seconds["device"]
        result["engine"]["host_fraction"] = host / total_seconds
    if roofline:
        from jaxinfer.bench import roofline as roofline_module

        peaks = roofline_module.measure_peaks(model.config.dtype)
        profiles = roofline_module.profile_engine(engine)
        result["roofline"] = roofline_module.roofline_json(profiles, peaks)
        result["roofline_table"] = roofline_module.roofline_table(profiles, peaks)
    if hf_model is not None:
        hf_warm_up_s = hf_peer.warm_up(hf_model, requests, hf_batch_size)
        hf_run = hf_peer.run_hf(hf_model, requests, hf_batch_size)
        check_lengths(requests, hf_run.token_ids, "transformers")
        result["hf"] = {**rates(requests, hf_run.elapsed_s), "warm_up_s": hf_warm_up_s,
                        "batch_size": hf_batch_size, "num_batches": hf_run.num_batches}
        result["engine_over_hf"] = (result["engine"]["output_tokens_per_s"]
                                    / result["hf"]["output_tokens_per_s"])
        result["hf_token_agreement"] = agreement(requests, run.token_ids, hf_run.token_ids)
        result["token_ids"]["hf"] = hf_run.token_ids
    return result


def throughput_table(result: dict[str, Any]) -> str:
    """The result as a markdown table (one row per side, plus the ratio)."""
    lines = ["| backend | requests/s | output tok/s | total tok/s | elapsed s | warm-up s "
             "| compiles in run |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    engine = result["engine"]
    lines.append(f"| jaxinfer engine | {engine['requests_per_s']:.2f} | "
                 f"{engine['output_tokens_per_s']:.1f} | {engine['total_tokens_per_s']:.1f} | "
                 f"{engine['elapsed_s']:.2f} | {engine['warm_up_s']:.1f} | "
                 f"{engine['compilations_during_run']} |")
    spec_line = speculative_line(result)
    if "hf" in result:
        hf = result["hf"]
        lines.append(f"| HF transformers (static batch {hf['batch_size']}) | "
                     f"{hf['requests_per_s']:.2f} | {hf['output_tokens_per_s']:.1f} | "
                     f"{hf['total_tokens_per_s']:.1f} | {hf['elapsed_s']:.2f} | "
                     f"{hf['warm_up_s']:.1f} | n/a |")
    if "vllm" in result:
        peer = result["vllm"]
        lines.append(f"| vLLM {peer['version']} (CPU) | {peer['requests_per_s']:.2f} | "
                     f"{peer['output_tokens_per_s']:.1f} | {peer['total_tokens_per_s']:.1f} | "
                     f"{peer['elapsed_s']:.2f} | {peer['warm_up_s']:.1f} | n/a |")
    if "hf" in result:
        lines.append(f"\nengine / HF output tok/s: **{result['engine_over_hf']:.2f}x**; "
                     f"token-identical requests: {result['hf_token_agreement']:.0%}")
    if "vllm" in result:
        lines.append(f"\nengine / vLLM output tok/s: **{result['engine_over_vllm']:.2f}x**; "
                     f"token-identical requests: {result['vllm_token_agreement']:.0%}")
    if "host_fraction" in engine:
        lines.append(f"\nhost share of the engine's step time (scheduling, packing, outputs): "
                     f"{engine['host_fraction']:.0%}")
    if "roofline_table" in result:
        lines += ["", "Steps against their roofline floor (after the run, same process):", "",
                  result["roofline_table"]]
    return "\n".join(lines) + spec_line


# ---------------------------------------------------------------------- reports


def machine_info() -> dict[str, Any]:
    """Platform, CPU count, Python/jax/torch/transformers versions, jax backend, UTC date."""
    import jax

    return {"platform": platform.platform(), "processor": platform.processor() or "unknown",
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "jax_backend": jax.default_backend(),
            "jax_devices": [str(device) for device in jax.devices()],
            **hf_peer.library_versions(), "git": _git_revision(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def _git_revision() -> str:
    """`git describe --always --dirty` of the source tree, or "unknown"."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed (`jaxinfer bench ...`)."""
    return " ".join(["jaxinfer", *(sys.argv[1:] if argv is None else argv)])


def write_json(path: str | os.PathLike[str], result: dict[str, Any]) -> None:
    """Writes the numbers (not the generated token ids) as indented JSON."""
    numbers = {key: value for key, value in result.items()
               if key not in ("token_ids", "roofline_table")}
    Path(path).write_text(json.dumps(numbers, indent=2) + "\n")


def append_markdown(path: str | os.PathLike[str], title: str, result: dict[str, Any],
                    table: str) -> None:
    """Appends a report section: title, command, machine, settings and the table."""
    machine = result["machine"]
    lines = [f"## {title} ({machine['date']})", "", f"```\n{result['command']}\n```", "",
             f"- machine: {machine['platform']}, {machine['cpu_count']} CPUs, "
             f"jax {machine['jax']} ({machine['jax_backend']}), torch {machine['torch']} "
             f"({machine.get('torch_threads', '?')} threads), transformers "
             f"{machine['transformers']}, Python {machine['python']}, git {machine['git']}",
             f"- model: {result['model']}"]
    settings = result.get("engine_settings")
    if settings:
        lines.append("- engine: " + ", ".join(f"{key}={value}" for key, value in
                                               settings.items()))
    lines += ["", table, ""]
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as file:
        file.write("\n".join(lines) + "\n")


def describe_model(model: Transformer, name: str) -> str:
    """`name` with its size: layers, widths, heads, vocab, dtype, parameter count."""
    import jax
    from flax import nnx

    config = model.config
    params = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return (f"{name} ({params / 1e6:.1f}M params: {config.num_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_heads} heads / {config.num_kv_heads} kv, MLP "
            f"{config.intermediate_size}, vocab {config.vocab_size}, {config.dtype})")
