"""The host KV tier on a multi-turn chat workload: the same run with and without it.

    python benchmarks/kv_offload.py [--model builtin:demo] [--out FILE] [--small]

Workload (the acceptance run of issue 24): 64 conversations of 6 turns. Every conversation
starts from one shared ~1k-token system prompt; each turn appends ~200 new tokens of real text
(the Python 3.11 documentation sources, `train_distill.corpus`'s python-docs split; Debian's
python3.11-doc) to the conversation's whole history so far (system prompt, earlier turns and
the model's answers), asks for 16 greedy tokens, and the conversation's next turn is submitted
as soon as that answer is complete (closed loop; every conversation starts at once). The
device page pool holds a quarter of the workload's working set (the shared prompt plus every
conversation's final context, in pages); the host tier (`kv_offload_bytes`) holds all of it.

Both engines are built and warmed up in one process and run one after the other on the same
workload. Reported for each: time to first token (submit to first token) p50 and p90, output
tokens per second over the run's wall time, prefill tokens computed and, of those, recomputed
(computed minus the tokens no earlier request held: the new turn's text, the last answer
token, and the system prompt once), and for the tiered run the host tier's hit rate (blocks and
admitted tokens), bytes moved each way, engine-thread copy seconds and the part of them spent
waiting for a copy that had not overlapped the step. Last, whether every answer is
token-identical between the two runs. The targets: recomputed prefill tokens down by >= 70%,
TTFT p50 >= 2x better.

Contexts reach ~2.3k tokens, past the demo model's 1024 trained positions: RoPE extends to
them, the answers are not meaningful text, and they do not need to be (both runs are compared
token for token). `--small` (8 conversations x 3 turns, 256 + 64-token turns) checks that the
script works in a minute on a laptop; its numbers are not the acceptance run's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

SECTION = "host-kv-tier"


@dataclass(frozen=True)
class Workload:
    """Token ids of the shared system prompt and of each conversation's turns."""

    system: list[int]
    turns: list[list[list[int]]]  # [conversation][turn] -> that turn's new tokens
    max_tokens: int


@dataclass
class RunResult:
    """One engine's run of the workload."""

    answers: dict[str, list[int]]
    ttft: list[float]
    wall_seconds: float
    output_tokens: int
    prefill_computed: int
    prefill_required: int
    stats: object

    @property
    def recomputed(self) -> int:
        return self.prefill_computed - self.prefill_required


def build_workload(tokenizer, conversations: int, turns: int, system_tokens: int,
                   turn_tokens: int, max_tokens: int) -> Workload:
    """Cuts the python-docs text into the system prompt and every turn's new tokens."""
    from train_distill.corpus import iter_documents

    needed = system_tokens + conversations * turns * turn_tokens
    tokens: list[int] = []
    for _, text in iter_documents(["python-docs"]):
        tokens += tokenizer.encode(text, add_special_tokens=False)
        if len(tokens) >= needed:
            break
    if len(tokens) < needed:
        raise RuntimeError(f"the python-docs corpus gave {len(tokens)} tokens, {needed} needed")
    system, rest = tokens[:system_tokens], tokens[system_tokens:]
    chunks = [[rest[(c * turns + t) * turn_tokens:(c * turns + t + 1) * turn_tokens]
               for t in range(turns)] for c in range(conversations)]
    return Workload(system, chunks, max_tokens)


def working_set_pages(workload: Workload, page_size: int) -> int:
    """Pages of the shared system prompt plus each conversation's own final context."""
    own = [sum(len(turn) for turn in turns) + (len(turns) - 1) * workload.max_tokens
           for turns in workload.turns]
    return -(-len(workload.system) // page_size) + sum(-(-tokens // page_size) for tokens in own)


def run(engine, workload: Workload) -> RunResult:
    """The closed-loop multi-turn run: each conversation's next turn on its last answer."""
    from jaxinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    histories = [list(workload.system) for _ in workload.turns]
    submitted: dict[str, float] = {}
    prompts: dict[str, list[int]] = {}
    answers: dict[str, list[int]] = {}
    ttft: dict[str, float] = {}
    required = 0

    def submit(conversation: int, turn: int) -> None:
        nonlocal required
        request_id = f"{conversation}-{turn}"
        prompt = histories[conversation] + workload.turns[conversation][turn]
        # What no earlier request held: this turn's text and the last answer token (never fed
        # back), and the system prompt for the very first request.
        shared = (len(histories[conversation]) - 1 if turn else
                  (len(workload.system) if conversation else 0))
        required += len(prompt) - shared
        prompts[request_id] = prompt
        submitted[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt, params)

    started = time.perf_counter()
    before = engine.stats().iteration_tokens_sum
    for conversation in range(len(workload.turns)):
        submit(conversation, 0)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            tokens = list(output.outputs[0].token_ids)
            if tokens and output.request_id not in ttft:
                ttft[output.request_id] = now - submitted[output.request_id]
            if not output.finished:
                continue
            answers[output.request_id] = tokens
            conversation, turn = map(int, output.request_id.split("-"))
            histories[conversation] = prompts[output.request_id] + tokens
            if turn + 1 < len(workload.turns[conversation]):
                submit(conversation, turn + 1)
    wall = time.perf_counter() - started
    stats = engine.stats()
    output_tokens = sum(len(tokens) for tokens in answers.values())
    # Every answer token but the last is fed back as a decode token; the rest was prefill.
    decode_fed = sum(len(tokens) - 1 for tokens in answers.values())
    return RunResult(answers, list(ttft.values()), wall, output_tokens,
                     stats.iteration_tokens_sum - before - decode_fed, required, stats)


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:demo")
    parser.add_argument("--small", action="store_true",
                        help="8 conversations x 3 turns of 64 tokens on a 256-token prompt")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/kv_memory.md"),
                        help="results file whose section to replace ('-': print only)")
    args = parser.parse_args(argv)

    from benchmarks.results_file import replace_section  # ROOT is on the path, not benchmarks/
    from jaxinfer.engine.factory import load_engine, load_model_config, load_tokenizer_of

    if args.small:
        conversations, turns, system_tokens, turn_tokens, max_tokens = 8, 3, 256, 64, 8
        max_num_seqs, budget = 4, 256
    else:
        conversations, turns, system_tokens, turn_tokens, max_tokens = 64, 6, 1000, 200, 16
        max_num_seqs, budget = 16, 512
    workload = build_workload(load_tokenizer_of(args.model, None), conversations, turns,
                              system_tokens, turn_tokens, max_tokens)
    pages = working_set_pages(workload, args.page_size)
    longest = system_tokens + turns * turn_tokens + turns * max_tokens
    max_model_len = -(-longest // args.page_size) * args.page_size
    # A quarter of the working set, but never less than one longest sequence needs.
    num_pages = max(pages // 4, max_model_len // args.page_size + 1) + 1
    config = load_model_config(args.model)
    block_bytes = (config.num_layers * args.page_size * 2 * config.num_kv_heads
                   * config.head_dim * (2 if config.dtype == "bfloat16" else 4))
    host_bytes = (pages + pages // 4) * block_bytes  # all of it, with room to spare
    options = dict(page_size=args.page_size, num_pages=num_pages, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=budget, max_model_len=max_model_len,
                   enable_prompt_logprobs=False)
    engines = {"device pool only": load_engine(args.model, **options),
               "with host tier": load_engine(args.model, kv_offload_bytes=host_bytes,
                                             **options)}
    for engine in engines.values():
        engine.warm_up()
    results = {name: run(engine, workload) for name, engine in engines.items()}
    plain, tiered = results["device pool only"], results["with host tier"]
    identical = sum(plain.answers[key] == tiered.answers.get(key) for key in plain.answers)

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    size = "small check (--small), not the acceptance run" if args.small else "acceptance run"
    lines = [f"## Host KV tier, multi-turn chat: {conversations} conversations x {turns} "
             f"turns, {args.model} ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
             "", f"Command: `python benchmarks/kv_offload.py --model {args.model}"
             f"{' --small' if args.small else ''}` ({size})  ",
             f"Machine: {platform.platform()}, {platform.processor() or 'cpu'}, "
             f"{os.cpu_count()} CPUs; git {git}.  ",
             f"System prompt {system_tokens} tokens, {turn_tokens} new tokens per turn, "
             f"{max_tokens} greedy output tokens per turn; page size {args.page_size}; "
             f"working set {pages} pages, device pool {num_pages - 1} pages "
             f"({(num_pages - 1) / pages:.0%}), host tier {host_bytes / 2 ** 20:.0f} MiB "
             f"({host_bytes // block_bytes} blocks of {block_bytes} bytes).", "",
             "| run | TTFT p50 (s) | TTFT p90 (s) | output tok/s | prefill computed | "
             "recomputed | wall (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, result in results.items():
        lines.append(f"| {name} | {statistics.median(result.ttft):.3f} | "
                     f"{_percentile(result.ttft, 0.9):.3f} | "
                     f"{result.output_tokens / result.wall_seconds:.1f} | "
                     f"{result.prefill_computed} | {result.recomputed} | "
                     f"{result.wall_seconds:.1f} |")
    stats = tiered.stats
    offload = engines["with host tier"].kv_offload
    cut = 1 - tiered.recomputed / plain.recomputed if plain.recomputed else 0.0
    speedup = statistics.median(plain.ttft) / statistics.median(tiered.ttft)
    lines += [
        "", f"Host tier: block hit rate {stats.host_cache_hit_rate:.1%} "
        f"({stats.host_cache_hits} of {stats.host_cache_queries} blocks looked up), "
        f"{stats.host_cache_token_hit_rate:.1%} of admitted prompt tokens "
        f"({stats.host_cache_hit_tokens}) loaded from it; "
        f"{stats.kv_bytes_to_host / 2 ** 20:.1f} MiB to host, "
        f"{stats.kv_bytes_to_device / 2 ** 20:.1f} MiB back; copies took "
        f"{stats.kv_copy_seconds:.3f} s of the engine thread (issuing "
        f"{offload.seconds['offload'] + offload.seconds['load']:.3f} s, collecting "
        f"{offload.seconds['collect']:.3f} s), of which {stats.kv_copy_blocked_seconds:.3f} s "
        f"waiting; {offload.num_ready} of {offload.num_ready + offload.num_waited} offload "
        f"batches had arrived when collected (overlapped the step).",
        "", f"Recomputed prefill tokens cut by {cut:.1%} (target >= 70%: "
        f"{'met' if cut >= 0.7 else 'not met'}); TTFT p50 {speedup:.2f}x better (target >= 2x: "
        f"{'met' if speedup >= 2 else 'not met'}). Answers token-identical: {identical} of "
        f"{len(plain.answers)}.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        replace_section(Path(args.out), SECTION + ("-small" if args.small else ""), text,
                        title="KV memory: host tier, low-bit KV caches and FP8 weights")
    return 0 if identical == len(plain.answers) else 1


if __name__ == "__main__":
    sys.exit(main())
