"""`jaxinfer bench latency`: decode latency at fixed batch sizes, optionally against HF.

For each batch size B (1, then e.g. 16), B prompts of `input_len` tokens generate exactly
`output_len` tokens (greedy, EOS ignored), `iterations` times, and the same prompts generate
one token, `iterations` times. The end-to-end latency is the median time of the full run; the
per-output-token decode latency is

    (median time(out = N) - median time(out = 1)) / (N - 1)

which removes the prefill (and the first token) from the decode cost. The engine and HF
`generate` (`jaxinfer.bench.hf_peer`) are measured the same way on the same prompts and weights,
and the report gives the ratio jaxinfer / HF (below 1 means jaxinfer decodes faster). Prefix
caching stays off, so a repeated prompt is prefilled every time on both sides.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxinfer.bench import hf_peer
from jaxinfer.bench.throughput import (
    build_engine,
    check_lengths,
    run_engine,
    speculative_line,
    speculative_summary,
)
from jaxinfer.bench.workload import BenchRequest, make_requests, with_output_len
from jaxinfer.engine.config import BENCH_DEFAULTS

if TYPE_CHECKING:
    from jaxinfer.models import Transformer


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """Parses `--batch-size`: one or more positive integers, comma-separated (`1,16`).

    Raises:
        ValueError: Anything else.
    """
    try:
        sizes = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes {text!r}: expected positive integers like 1,16")
    return tuple(dict.fromkeys(sizes))


# The latency benchmark's engine defaults: the throughput benchmark's, except that the batch
# sizes size the engine (None below: see `latency_engine_options`) and the smallest token
# bucket is 1, so a decode step of a small batch is not padded to a throughput-sized bucket.
LATENCY_DEFAULTS: dict[str, Any] = {**BENCH_DEFAULTS, "max_num_seqs": None,
                                    "max_num_batched_tokens": None, "min_token_bucket": 1}


def latency_engine_options(options: Mapping[str, Any] | None, batch_sizes: Sequence[int],
                           input_len: int) -> dict[str, Any]:
    """`options` over `LATENCY_DEFAULTS`, with the sizes left None filled in: `max_num_seqs`
    the largest batch, `max_num_batched_tokens` `default_token_budget` (at least
    `max_num_seqs`)."""
    sized = {**LATENCY_DEFAULTS, **(options or {})}
    if sized["max_num_seqs"] is None:
        sized["max_num_seqs"] = max(batch_sizes)
    if sized["max_num_batched_tokens"] is None:
        sized["max_num_batched_tokens"] = max(sized["max_num_seqs"],
                                              default_token_budget(batch_sizes, input_len))
    return sized


def default_token_budget(batch_sizes: Sequence[int], input_len: int) -> int:
    """The smallest power of two that holds one whole prompt and a decode of every request.

    Larger batches then prefill one prompt per step (chunked, mixed with the decodes of the
    requests already running), which keeps the (token x sequence) buckets warm-up compiles
    few; the decode latency is unaffected (t(1) includes the same prefill steps as t(N)).
    """
    need = max(max(batch_sizes), input_len)
    budget = 1
    while budget < need:
        budget *= 2
    return budget


@dataclasses.dataclass
class Timing:
    """Latency of one side at one batch size.

    Attributes:
        full_s: Per iteration, seconds to generate `output_len` tokens.
        first_s: Per iteration, seconds to generate 1 token (prefill + first token).
        output_len: N.
    """

    full_s: list[float]
    first_s: list[float]
    output_len: int

    @property
    def e2e_s(self) -> float:
        """Median end-to-end seconds of the full run."""
        return statistics.median(self.full_s)

    @property
    def decode_ms_per_token(self) -> float:
        """(median full - median first) / (N - 1), in milliseconds."""
        extra = statistics.median(self.full_s) - statistics.median(self.first_s)
        return 1000.0 * extra / (self.output_len - 1)

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (medians and the raw samples)."""
        return {"decode_ms_per_token": self.decode_ms_per_token, "e2e_s": self.e2e_s,
                "first_token_s": statistics.median(self.first_s),
                "full_s": self.full_s, "first_s": self.first_s}


def time_side(run: Callable[[Sequence[BenchRequest]], float],
              requests: Sequence[BenchRequest], iterations: int) -> Timing:
    """Times `run` (seconds for a batch) at `output_len` and at 1 token, interleaved."""
    output_len = requests[0].output_len
    single = with_output_len(requests, 1)
    full_s, first_s = [], []
    for _ in range(iterations):
        full_s.append(run(requests))
        first_s.append(run(single))
    return Timing(full_s, first_s, output_len)


def run_latency(model: Transformer, *, batch_sizes: Sequence[int], input_len: int,
                output_len: int, iterations: int, options: Mapping[str, Any] | None = None,
                compare_hf: bool = False, hf_threads: int | None = None,
                seed: int = 0) -> dict[str, Any]:
    """The latency benchmark.

    Args:
        model: The model both sides run.
        batch_sizes: Batch sizes to measure, e.g. (1, 16).
        input_len: Prompt length of every request.
        output_len: Tokens generated per request (N >= 2).
        iterations: Timed runs per (side, batch size, N or 1); medians are reported.
        options: Flat engine options over `LATENCY_DEFAULTS`; the sizes left out or None
            are sized for the batches (`latency_engine_options`).
        compare_hf: Also time transformers `generate` on the same prompts and weights.
        hf_threads: torch intra-op threads (None: torch's default).
        seed: Seeds the prompts.

    Returns:
        A JSON-ready dict with "engine" (warm_up_s, compilations_during_run) and one entry
        per batch size in "rows": {"batch_size", "engine": {...}, "hf": {...},
        "engine_over_hf"} (decode ms/token ratio), and token agreement with HF.

    Raises:
        ValueError: output_len < 2, iterations < 1.
        HFUnavailableError: compare_hf without torch/transformers (raised before any work).
    """
    if output_len < 2:
        raise ValueError(f"output_len = {output_len}: need >= 2 to separate decode from prefill")
    if iterations < 1:
        raise ValueError(f"iterations = {iterations}: must be >= 1")
    options = latency_engine_options(options, batch_sizes, input_len)
    hf_model = hf_peer.load_hf_peer(model, hf_threads) if compare_hf else None
    engine = build_engine(model, options, input_len + output_len)
    warm_up_s = engine.warm_up()
    compiled_before = engine.compilations
    vocab = model.config.vocab_size
    rows = []
    for batch_size in batch_sizes:
        requests = make_requests(batch_size, vocab_size=vocab, input_len=input_len,
                                 output_len=output_len, seed=seed + batch_size,
                                 prefix=f"latency-b{batch_size}")
        engine_tokens: dict[str, list[int]] = {}

        def engine_seconds(batch: Sequence[BenchRequest],
                           tokens: dict[str, list[int]] = engine_tokens) -> float:
            run = run_engine(engine, batch)
            if batch[0].output_len == output_len:  # keep the full runs' tokens only
                tokens.update(run.token_ids)
            return run.elapsed_s

        engine_seconds(requests[:1])  # first use of this batch's shapes' host paths
        row: dict[str, Any] = {"batch_size": batch_size,
                               "engine": time_side(engine_seconds, requests,
                                                   iterations).summary()}
        check_lengths(requests, engine_tokens, "the engine")
        if hf_model is not None:
            hf_tokens: dict[str, list[int]] = {}

            def hf_seconds(batch: Sequence[BenchRequest],
                           tokens: dict[str, list[int]] = hf_tokens) -> float:
                seconds, generated = hf_peer.time_generate(
                    hf_model, [request.prompt_token_ids for request in batch],
                    batch[0].output_len)
                if batch[0].output_len == output_len:
                    tokens.update({request.request_id: ids for request, ids in
                                   zip(batch, generated, strict=True)})
                return seconds

            hf_peer.warm_up(hf_model, requests, batch_size)
            row["hf"] = time_side(hf_seconds, requests, iterations).summary()
            row["engine_over_hf"] = (row["engine"]["decode_ms_per_token"]
                                     / row["hf"]["decode_ms_per_token"])
            row["hf_token_agreement"] = sum(
                engine_tokens[request.request_id] == hf_tokens[request.request_id]
                for request in requests) / len(requests)
        rows.append(row)
    return {"benchmark": "latency", "input_len": input_len, "output_len": output_len,
            "iterations": iterations, "batch_sizes": list(batch_sizes),
            "engine_settings": engine.config.options(),
            "engine": {"warm_up_s": warm_up_s,
                       "compilations_during_run": engine.compilations - compiled_before,
                       "programs": engine.compilations},
            "speculative": speculative_summary(engine),
            "rows": rows}


def latency_table(result: dict[str, Any]) -> str:
    """The result as a markdown table: one row per (batch size, side)."""
    lines = [f"input {result['input_len']} tokens, output {result['output_len']} tokens, "
             f"median of {result['iterations']}; engine warm-up "
             f"{result['engine']['warm_up_s']:.1f} s, compiles during the run "
             f"{result['engine']['compilations_during_run']}", "",
             "| batch | backend | decode ms/token | end-to-end s | first token s "
             "| jaxinfer / HF decode |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        sides = [("jaxinfer engine", row["engine"])]
        if "hf" in row:
            sides.append(("HF transformers", row["hf"]))
        for name, side in sides:
            ratio = f"{row['engine_over_hf']:.2f}x" if "hf" in row and side is row["engine"] \
                else ""
            lines.append(f"| {row['batch_size']} | {name} | {side['decode_ms_per_token']:.2f} "
                         f"| {side['e2e_s']:.3f} | {side['first_token_s']:.3f} | {ratio} |")
    return "\n".join(lines) + speculative_line(result)
