"""Low-bit KV caches side by side on the demo teacher, in one run.

    python benchmarks/kv_dtypes.py --out benchmarks/results/kv_dtypes.md

For each KV cache dtype (fp32, int8, fp8_e4m3, fp8_e5m2, KIVI int4 and int2):

- held-out PPL through the engine's paged path (`jaxinfer.perplexity`, every window one
  prefill into a fresh paged cache) at contexts 512 and 2048, and its ratio to fp32;
- bytes per token (every layer's K and V, scales and zero points included; KIVI's float32
  residual pool of one page per running sequence listed apart);
- how many 2k-token sequences fit a fixed pool budget (`--pool-mib`, residual seats included);
- KIVI's residual window: streamed PPL, where the scored half of each window is decoded one
  token per step through the paged path (a query sees the pages completed before it
  rounded and its own partial page exact, as in serving), at page sizes 8 to 64 (the page is
  both the key group and the residual window: the newest `kv_len % Z` tokens stay exact),
  against the same stream with a float cache (the prefill rows above are the other extreme:
  there a query's own page is rounded as soon as the prefill completes it);
- `decode_tokens_per_second`: engine decode tok/s at batch 64 per dtype (`--decode`; a timing
  run wants a quiet machine).

The demo teacher was trained at 1024 positions; contexts past it extrapolate RoPE, so the
2048 PPLs are higher for every dtype (the ratios are what compare). Needs Debian's
python3.11-doc (the corpus source).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Run as a script, this folder leads sys.path, and its modules (kernels.py, ...) would shadow
# installed packages of the same name.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxinfer.bench.throughput import build_engine, machine_info, submit  # noqa: E402
from jaxinfer.bench.workload import make_requests  # noqa: E402
from jaxinfer.kv_formats import KIVI_BITS, kivi_residual_bytes  # noqa: E402
from jaxinfer.model_loading import load_model, resolve_model_path  # noqa: E402
from jaxinfer.models import PagedBatch, PagedKVCache, Transformer  # noqa: E402
from jaxinfer.perplexity import perplexity  # noqa: E402
from jaxinfer.quant.kv_cache import kv_bytes_per_token  # noqa: E402
from jaxinfer.tokenizer import load_tokenizer  # noqa: E402
from train_distill.corpus import build_corpus  # noqa: E402
from train_distill.data import tokenize_split  # noqa: E402

DTYPES = ("float32", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")
SEQUENCE_TOKENS = 2048  # the capacity column's sequence length


@dataclasses.dataclass(frozen=True)
class Row:
    """One KV dtype's numbers."""

    name: str
    ppl: dict[int, float]  # context -> PPL through the paged path
    bytes_per_token: float
    residual_bytes_per_sequence: int
    max_sequences: int


def max_sequences(pool_bytes: int, bytes_per_token: float, residual_per_sequence: int,
                  sequence_tokens: int = SEQUENCE_TOKENS) -> int:
    """Sequences of `sequence_tokens` whose pages (and KIVI residual seats) fit the pool."""
    return int(pool_bytes // (bytes_per_token * sequence_tokens + residual_per_sequence))


def streamed_nll(model: Transformer, windows: np.ndarray, kv_cache_dtype: str,
                 page_size: int, prefix: int) -> tuple[float, int]:
    """Total NLL and count of the tokens after `prefix` in each window `[B, T]`, each fed
    by its own decode step through the paged path (the first `prefix` tokens one prefill).

    Returns:
        `(nll, tokens)` over the B * (T - prefix - 1) scored tokens.
    """
    rows, length = windows.shape
    pages_per_row = -(-length // page_size)
    first_page = 1 + pages_per_row * np.arange(rows)  # [B]; page 0 is the null page
    page_indices = jnp.asarray(first_page[:, None] + np.arange(pages_per_row),
                               jnp.int32)  # [B, pages_per_row]
    graphdef, state = nnx.split(model)

    def batch_for(start: int, count: int) -> PagedBatch:
        offsets = np.arange(start, start + count)  # [count]
        slots = ((first_page[:, None] + offsets[None, :] // page_size) * page_size
                 + offsets[None, :] % page_size)  # [B, count]
        return PagedBatch(jnp.asarray(slots.reshape(-1), jnp.int32),
                          jnp.full((rows,), start + count, jnp.int32), page_indices,
                          jnp.asarray(count * np.arange(rows + 1), jnp.int32),
                          jnp.asarray([rows], jnp.int32), jnp.arange(rows, dtype=jnp.int32))

    @jax.jit
    def step(state: nnx.State, pages: jax.Array, scales: Any, tokens: jax.Array,
             positions: jax.Array, batch: PagedBatch) -> tuple[jax.Array, Any, jax.Array]:
        model = nnx.merge(graphdef, state)
        cache = PagedKVCache(pages, batch, scales)
        hidden, cache = model.hidden_states(tokens.reshape(1, -1), positions.reshape(1, -1),
                                            cache)  # [1, B * count, D]
        last = hidden[:, batch.cu_q_lens[1:] - 1]  # [1, B, D]
        return cache.pages, cache.scales, jax.nn.log_softmax(model.logits(last)[0], -1)

    empty = batch_for(0, 1)
    cache = PagedKVCache.create(model.config, 1 + rows * pages_per_row, page_size, empty,
                                dtype=kv_cache_dtype, num_residual=rows)
    pages, scales = cache.pages, cache.scales
    tokens = jnp.asarray(windows, jnp.int32)  # [B, T]
    pages, scales, log_probs = step(state, pages, scales, tokens[:, :prefix].reshape(-1),
                                    jnp.tile(jnp.arange(prefix), rows), batch_for(0, prefix))
    total = 0.0
    for position in range(prefix, length - 1):
        total -= float(jnp.sum(jnp.take_along_axis(log_probs, tokens[:, position, None],
                                                   axis=1)))
        pages, scales, log_probs = step(state, pages, scales, tokens[:, position],
                                        jnp.full((rows,), position, jnp.int32),
                                        batch_for(position, 1))
    total -= float(jnp.sum(jnp.take_along_axis(log_probs, tokens[:, length - 1, None], axis=1)))
    return total, rows * (length - prefix)


def decode_tokens_per_second(model: Transformer, kv_cache_dtypes: Sequence[str],
                             batch_size: int = 64, input_len: int = 32, rounds: int = 6,
                             steps: int = 8) -> dict[str, dict[str, float]]:
    """Engine decode tokens/s at `batch_size` per KV dtype, the dtypes timed in turns.

    One engine per dtype holds the same `batch_size` greedy requests. Once every request has
    its first token, the engines take turns, `steps` decode steps each, for `rounds` rounds:
    this VM's speed drifted by up to 1.5x between processes (the same float32 weights' matmuls
    ran 1.45x slower in one dtype's process than in another's), and turns within one process
    see the same drift. A dtype's figure is B * 1000 / its fastest turn's ms per step, with the
    median turn beside it.
    """
    output_len = input_len + (rounds + 2) * steps + 8  # never finishes while timed
    requests = make_requests(batch_size, vocab_size=model.config.vocab_size,
                             input_len=input_len, output_len=output_len, seed=0,
                             prefix="kv-decode")
    engines = {}
    for name in kv_cache_dtypes:
        # Prefill chunks of up to a prompt (the decode steps' bucket is the batch's either way).
        options = dict(max_num_seqs=batch_size, min_token_bucket=1,
                       max_num_batched_tokens=max(batch_size, 32, input_len), bucket_growth=8,
                       kv_cache_dtype=None if name == "float32" else name)
        engine = build_engine(model, options, input_len + output_len)
        engine.warm_up()
        for request in requests:
            submit(engine, request)
        scheduler = engine.scheduler
        while scheduler.waiting or any(request.num_computed_tokens < request.num_tokens - 1
                                       for request in scheduler.running):
            engine.step()  # the prefills
        for _ in range(steps):
            engine.step()  # one untimed turn
        engines[name] = engine
    turns: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            turns[name].append((time.perf_counter() - started) * 1e3 / steps)
    return {name: {"tokens_per_s": batch_size * 1000.0 / min(times),
                   "median_tokens_per_s": batch_size * 1000.0 / statistics.median(times),
                   "ms_per_step": times}
            for name, times in turns.items()}


def validation_tokens(corpus: Path, model_name: str, count: int) -> np.ndarray:
    """The first `count` tokens of the held-out Python-docs split."""
    if not (corpus / "validation.txt").is_file():
        build_corpus(corpus, ["python-docs"])
    tokenizer = load_tokenizer(resolve_model_path(model_name))
    return np.asarray(tokenize_split(corpus, "validation", tokenizer)[:count], np.int32)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = load_model(args.model)
    config = model.config
    contexts = tuple(int(size) for size in args.contexts.split(","))
    dtypes = [name for name in args.dtypes.split(",") if name]
    stream_dtypes = [name for name in args.stream_dtypes.split(",") if name]
    # `--dtypes "" --stream-dtypes "" --decode` times decode alone (no corpus needed).
    tokens = (validation_tokens(Path(args.corpus), args.model, args.ppl_tokens + 1)
              if dtypes or stream_dtypes else None)
    pool_bytes = args.pool_mib * 2 ** 20
    rows = []
    for name in dtypes:
        started = time.perf_counter()
        ppl = {context: perplexity(model, tokens, window=context, batch_size=args.batch_size,
                                   kv_cache_dtype=name).ppl for context in contexts}
        per_token = kv_bytes_per_token(config, None if name == "float32" else name)
        # One residual seat (a page of float32 rows) per running sequence.
        residual = (kivi_residual_bytes(config.num_cache_layers, config.num_kv_heads,
                                        config.head_dim, 16, 1) if name in KIVI_BITS else 0)
        row = Row(name, ppl, per_token, residual, max_sequences(pool_bytes, per_token, residual))
        rows.append(row)
        print(json.dumps({**dataclasses.asdict(row), "seconds": time.perf_counter() - started}),
              flush=True)
    streamed = []
    prefix = args.stream_context // 2
    if stream_dtypes:
        windows = tokens[:args.stream_windows * args.stream_context].reshape(
            args.stream_windows, args.stream_context)  # [B, T]
        float_nll, count = streamed_nll(model, windows, "float32", 16, prefix)
    for name in stream_dtypes:
        for page_size in (int(size) for size in args.stream_pages.split(",")):
            nll, _ = streamed_nll(model, windows, name, page_size, prefix)
            entry = {"name": name, "page_size": page_size, "ppl": math.exp(nll / count),
                     "float_ppl": math.exp(float_nll / count), "tokens": count}
            streamed.append(entry)
            print(json.dumps(entry), flush=True)
    decode = {}
    if args.decode:
        decode = decode_tokens_per_second(
            model, [name for name in args.decode_dtypes.split(",") if name],
            batch_size=args.decode_batch, input_len=args.decode_input_len)
        print(json.dumps({"decode": decode}), flush=True)
    return {"rows": [dataclasses.asdict(row) for row in rows], "streamed": streamed,
            "decode": decode, "decode_batch": args.decode_batch,
            "decode_input_len": args.decode_input_len, "contexts": contexts,
            "pool_mib": args.pool_mib,
            "stream": [args.stream_windows, args.stream_context, prefix],
            "machine": machine_info()}


def markdown(results: dict[str, Any], command: str) -> str:
    rows = results["rows"]
    contexts = results["contexts"]
    machine = results["machine"]
    windows, context, prefix = results["stream"]
    lines = [
        "# Low-bit KV caches on the demo teacher",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine['platform']}, {machine['cpu_count']} CPUs (shared), jax "
        f"{machine['jax']} ({machine['jax_backend']}), git {machine['git']}",
        f"- Date: {machine['date']}",
        "- Model: `builtin:demo` (8 layers, 4 KV heads of 32, fp32, trained at 1024 "
        "positions: 2048 extrapolates RoPE for every dtype). Held-out Python-docs split, "
        "disjoint windows, each one prefill through the engine's paged path (pages of 16).",
        "- Bytes per token: K and V of every layer, scales and zero points included. KIVI "
        "also holds a float32 residual page per running sequence (listed apart, and counted "
        f"in the capacity column: 2048-token sequences in a {results['pool_mib']} MiB pool).",
        "",
    ]
    if rows:
        lines += [
            "| KV dtype | " + " | ".join(f"PPL @ {c} | / fp32" for c in contexts)
            + " | bytes / token | / fp32 | residual bytes / seq | 2k seqs in pool |",
            "| --- | " + " | ".join("---: | ---:" for _ in contexts)
            + " | ---: | ---: | ---: | ---: |",
        ]
    base = rows[0] if rows else None
    for row in rows:
        cells = " | ".join(f"{row['ppl'][c]:.3f} | {row['ppl'][c] / base['ppl'][c]:.4f}"
                           for c in contexts)
        lines.append(f"| {row['name']} | {cells} | {row['bytes_per_token']:,.0f} | "
                     f"{row['bytes_per_token'] / base['bytes_per_token']:.3f} | "
                     f"{row['residual_bytes_per_sequence']:,} | {row['max_sequences']} |")
    lines += [] if not results["streamed"] else [
        "",
        "## KIVI's residual window (streamed decode)",
        "",
        f"{windows} windows of {context} tokens: the first {prefix} prefilled, the rest fed one "
        "token per step through the paged path, scored as they are decoded. The page is the "
        "key group and the residual window (the newest kv_len % Z tokens exact, Z - 1 at "
        "most). Bytes per token count the page's key scales over its Z tokens.",
        "",
        "| KV dtype | page (group, residual) | streamed PPL | / float cache |",
        "| --- | ---: | ---: | ---: |",
    ]
    for entry in results["streamed"]:
        lines.append(f"| {entry['name']} | {entry['page_size']} | {entry['ppl']:.3f} | "
                     f"{entry['ppl'] / entry['float_ppl']:.4f} |")
    if results["decode"]:
        decode = results["decode"]
        base = decode.get("float32", {}).get("tokens_per_s")
        lines += ["", f"## Decode tok/s (batch {results['decode_batch']}, "
                  f"{results.get('decode_input_len', 32)}-token prompts, "
                  "greedy; the dtypes' engines timed in turns of 8 steps, 6 rounds)", "",
                  "| KV dtype | tok/s (fastest turn) | / fp32 | tok/s (median turn) | / fp32 |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, row in decode.items():
            best, median = row["tokens_per_s"], row["median_tokens_per_s"]
            base_median = decode.get("float32", {}).get("median_tokens_per_s")
            lines.append(f"| {name} | {best:.0f} | {best / base:.2f} | {median:.0f} | "
                         f"{median / base_median:.2f} |" if base else
                         f"| {name} | {best:.0f} | - | {median:.0f} | - |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:demo")
    parser.add_argument("--corpus", default="data/corpus",
                        help="corpus directory (built from python3.11-doc if missing)")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--ppl-tokens", type=int, default=8192,
                        help="held-out tokens scored per context (16384: ~2x the time)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per forward")
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--stream-windows", type=int, default=4)
    parser.add_argument("--stream-context", type=int, default=256)
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="KV dtypes of the PPL table (the first is the baseline)")
    parser.add_argument("--stream-dtypes", default="int4,int2")
    parser.add_argument("--stream-pages", default="8,16,32,64")
    parser.add_argument("--decode", action="store_true", help="also time decode (quiet machine)")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-input-len", type=int, default=32,
                        help="prompt tokens of each --decode request")
    parser.add_argument("--decode-dtypes", default=",".join(DTYPES),
                        help="KV dtypes timed by --decode (float32 first: the ratios' base)")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--out", default="benchmarks/results/kv_dtypes.md")
    args = parser.parse_args(argv)
    command = "python " + shlex.join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])])
    results = measure(args)
    text = markdown(results, command)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
