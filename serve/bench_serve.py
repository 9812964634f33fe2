"""`jaxinfer bench serve`: a load test of a running server, in the shape of vLLM's.

Requests arrive as a Poisson process at `--request-rate` per second (a gamma process with
`--burstiness` != 1; `inf` sends everything at once), at most `--max-concurrency` in flight,
each streaming its tokens back. Per request the client records the time to first token (TTFT),
the gaps between streamed chunks (inter-token latency, ITL), the time per output token after
the first (TPOT = (latency - TTFT) / (tokens - 1)) and the end-to-end latency; the report gives
throughput and their mean / p50 / p90 / p99. Both front ends are supported: `openai` (streaming
`/v1/completions`, usage from `stream_options.include_usage`) and `grpc`
(`jaxinfer.v1.Inference/Generate`).

Random prompts are token ids drawn from the model's vocabulary (so the prompt length is exact)
and generate exactly `--random-output-len` tokens (`ignore_eos`); `--dataset-path` takes a text
file with one prompt per line (or JSON lines with a "prompt" field) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from serve.bench_clients import CLIENTS, RequestResult, StreamClient


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    """One request of the load: text or token ids, and the tokens to generate."""

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int


def random_prompts(num_prompts: int, vocab_size: int, input_len: int, output_len: int,
                   range_ratio: float, seed: int) -> list[BenchPrompt]:
    """Token-id prompts with lengths uniform in input_len * [1 - r, 1 + r] (likewise output)."""
    rng = np.random.default_rng(seed)

    def lengths(center: int) -> np.ndarray:
        low, high = max(1, int(center * (1 - range_ratio))), max(1, int(center * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    prompts = []
    for input_tokens, output_tokens in zip(lengths(input_len), lengths(output_len), strict=True):
        ids = rng.integers(0, vocab_size, size=int(input_tokens)).tolist()
        prompts.append(BenchPrompt(ids, int(input_tokens), int(output_tokens)))
    return prompts


def file_prompts(path: str, num_prompts: int, output_len: int) -> list[BenchPrompt]:
    """The first `num_prompts` prompts of a text or JSON-lines file (cycled if fewer)."""
    texts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                texts.append(str(json.loads(line)["prompt"]))
            else:
                texts.append(line)
    if not texts:
        raise ValueError(f"--dataset-path {path}: no prompts in the file")
    return [BenchPrompt(texts[index % len(texts)], None, output_len)
            for index in range(num_prompts)]


def arrival_gaps(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive arrivals: gamma(shape=burstiness) with mean 1/rate."""
    if rate == float("inf"):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed + 1)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num_requests).tolist()


async def run_load(client: StreamClient, prompts: Sequence[BenchPrompt], request_rate: float,
                   burstiness: float, max_concurrency: int | None,
                   seed: int) -> tuple[list[RequestResult], float]:
    """Sends every prompt on its arrival schedule; returns the results and the wall time."""
    limit = asyncio.Semaphore(max_concurrency or len(prompts))

    async def one(prompt: BenchPrompt) -> RequestResult:
        async with limit:
            return await client.request(prompt.prompt, prompt.output_len)

    tasks = []
    started = time.perf_counter()
    for prompt, gap in zip(prompts, arrival_gaps(len(prompts), request_rate, burstiness, seed),
                           strict=True):
        tasks.append(asyncio.create_task(one(prompt)))
        if gap:
            await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - started


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan")}
    array = np.asarray(values) * 1000.0  # milliseconds
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)),
            "p90": float(np.percentile(array, 90)), "p99": float(np.percentile(array, 99))}


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Throughput and latency statistics (milliseconds) over the successful requests."""
    done = [result for result in results if result.error is None]
    output_tokens = sum(result.output_tokens for result in done)
    prompt_tokens = sum(result.prompt_tokens for result in done)
    tpot = [(result.latency_s - result.ttft_s) / (result.output_tokens - 1)
            for result in done if result.output_tokens > 1 and result.ttft_s is not None]
    errors: dict[str, int] = {}
    for result in results:
        if result.error is not None:
            errors[result.error] = errors.get(result.error, 0) + 1
    return {
        "duration_s": duration_s, "completed": len(done), "failed": len(results) - len(done),
        "errors": errors, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": _percentiles([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([gap for r in done for gap in r.itl_s]),
        "e2el_ms": _percentiles([r.latency_s for r in done]),
    }


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per (backend, rate) run."""
    lines = ["| backend | rate req/s | concurrency | completed | failed | req/s | output tok/s "
             "| TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        def pair(name: str, row: dict[str, Any] = row) -> str:
            return f"{row[name]['p50']:.1f} / {row[name]['p99']:.1f}"

        lines.append(
            f"| {row['backend']} | {row['request_rate']} | {row['max_concurrency'] or '-'} "
            f"| {row['completed']} | {row['failed']} | {row['request_throughput']:.2f} "
            f"| {row['output_throughput']:.1f} | {pair('ttft_ms')} | {pair('tpot_ms')} "
            f"| {pair('itl_ms')} | {pair('e2el_ms')} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `jaxinfer bench serve` (vLLM's names where they exist)."""
    parser.add_argument("--backend", choices=sorted(CLIENTS), default="openai",
                        help="front end: openai (/v1/completions) or grpc (Generate)")
    parser.add_argument("--host", default="127.0.0.1", help="server host")
    parser.add_argument("--port", type=int, default=None,
                        help="server port (default: 8000 for openai, 50051 for grpc)")
    parser.add_argument("--model", default=None,
                        help="model name in the requests (default: the server's)")
    parser.add_argument("--api-key", default=None, help="the server's --api-key")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                        help="arrivals per second (several: one run each); inf: all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (default: no limit)")
    parser.add_argument("--random-input-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--random-output-len", type=int, default=32, help="output tokens")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in len * [1 - r, 1 + r]")
    parser.add_argument("--dataset-path", default=None,
                        help="prompts file (one per line, or JSON lines with 'prompt')")
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    parser.add_argument("--output-json", metavar="PATH", help="write the numbers as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="append a markdown report section")


def run_from_args(args: argparse.Namespace) -> int:
    """Runs one load per request rate against the server and prints the table."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts = {args.num_prompts}: must be >= 1")
    port = args.port or (8000 if args.backend == "openai" else 50051)
    client = CLIENTS[args.backend](args.host, port, args.model, args.api_key)
    rows = []

    async def main() -> None:
        info = await client.model_info()
        if args.dataset_path:
            prompts = file_prompts(args.dataset_path, args.num_prompts, args.random_output_len)
        else:
            prompts = random_prompts(args.num_prompts, info["vocab_size"],
                                     args.random_input_len, args.random_output_len,
                                     args.random_range_ratio, args.seed)
        for rate in args.request_rate:
            results, duration = await run_load(client, prompts, rate, args.burstiness,
                                               args.max_concurrency, args.seed)
            rows.append({"backend": args.backend, "request_rate": rate,
                         "max_concurrency": args.max_concurrency, "model": info["name"],
                         **summarize(results, duration)})
        await client.close()

    asyncio.run(main())
    table = summary_table(rows)
    print(table)
    for row in rows:
        if row["errors"]:
            print(f"rate {row['request_rate']}: errors {row['errors']}")
    result = {"benchmark": "serve", "num_prompts": args.num_prompts,
              "random_input_len": args.random_input_len,
              "random_output_len": args.random_output_len, "runs": rows}
    from jaxinfer.bench.throughput import append_markdown, command_line, machine_info, write_json

    result["command"] = command_line(["bench", "serve", *_argv_tail(args)])
    result["model"] = f"{rows[0]['model']} (served at {args.host}:{port})"
    result["machine"] = machine_info()
    if args.output_json:
        write_json(args.output_json, result)
    if args.markdown:
        append_markdown(args.markdown, "jaxinfer bench serve", result, table)
    return 0 if all(row["completed"] for row in rows) else 1


def _argv_tail(args: argparse.Namespace) -> list[str]:
    argv = list(getattr(args, "argv", []))
    return argv[2:] if argv[:2] == ["bench", "serve"] else argv
