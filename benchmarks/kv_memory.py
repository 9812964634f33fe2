"""KV memory beyond the device, every figure of `benchmarks/results/kv_memory.md` in one run.

    python benchmarks/kv_memory.py --corpus /tmp/pcorpus

On the demo teacher (`builtin:demo`):

1. **Low-bit KV quality and size** (load-independent): held-out PPL through the engine's paged
   path at contexts 512 and 2048 for fp32, int8, fp8_e4m3, fp8_e5m2 and KIVI int4 / int2, its
   ratio to fp32, bytes per token, and the 2k-token sequences a fixed pool holds; KIVI's
   residual window measured by streamed decode at two page sizes (`kv_dtypes.py` has the
   functions and the longer study).
2. **FP8 weights** (load-independent part): PPL of fp32, bf16, int8 per channel and fp8 e4m3
   per channel weights, and the blocks' linear weight bytes.
3. **The timed phase**, once the machine is quiet (`benchmarks/machine_load.py`: it waits for a
   low load average, takes a lock so no other benchmark's timed phase overlaps, and records
   the load and the machine's peaks):
   - engine decode tok/s at batch 64 for each KV dtype (`--decode-context`-token prompts);
   - engine decode tok/s at batch 1 and 32 for each weight format;
   - the host KV tier's multi-turn workload, with and without the tier
     (`benchmarks/kv_offload.py`, which writes its own section of the same file).

Needs Debian's python3.11-doc (the corpus source). About 40 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import kv_offload  # noqa: E402
from benchmarks.kv_dtypes import (  # noqa: E402
    DTYPES,
    SEQUENCE_TOKENS,
    max_sequences,
    streamed_nll,
    validation_tokens,
)
from benchmarks.machine_load import describe, quiet_phase  # noqa: E402
from benchmarks.results_file import replace_section  # noqa: E402
from jaxinfer.bench.latency import run_latency  # noqa: E402
from jaxinfer.bench.throughput import machine_info  # noqa: E402
from jaxinfer.kv_formats import KIVI_BITS, kivi_residual_bytes  # noqa: E402
from jaxinfer.model_loading import load_model  # noqa: E402
from jaxinfer.models import Transformer  # noqa: E402
from jaxinfer.perplexity import perplexity  # noqa: E402
from jaxinfer.quant import QuantizationConfig, linear_weight_bytes  # noqa: E402
from jaxinfer.quant.kv_cache import kv_bytes_per_token  # noqa: E402
from jaxinfer.quant.methods import apply_method  # noqa: E402

TITLE = "KV memory: host tier, low-bit KV caches and FP8 weights"
WEIGHT_FORMATS = ("fp32 (checkpoint)", "bf16", "int8 per channel", "fp8 e4m3 per channel")


def log(message: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def weight_variant(name: str, model_name: str) -> Transformer:
    """The demo teacher with its block and head weights in one of `WEIGHT_FORMATS`."""
    if name == "bf16":
        return load_model(model_name, dtype="bfloat16", param_dtype="bfloat16")
    model = load_model(model_name)
    if name.startswith("int8"):
        return apply_method(model, QuantizationConfig.for_method("rtn", bits=8), None)
    if name.startswith("fp8"):
        return apply_method(model, QuantizationConfig.for_method("rtn", weight_format="fp8"),
                            None)
    return model


def decode_rates(model: Transformer, batch_sizes: tuple[int, ...], input_len: int,
                 kv_cache_dtype: str | None, iterations: int) -> dict[int, float]:
    """Engine decode tok/s per batch size: B * 1000 / (ms per decode step), greedy
    (`jaxinfer.bench.latency`: (t(N) - t(1)) / (N - 1) per step, medians)."""
    options = dict(max_num_seqs=max(batch_sizes), min_token_bucket=1,
                   max_num_batched_tokens=max(max(batch_sizes), 512), bucket_growth=8,
                   kv_cache_dtype=kv_cache_dtype)
    result = run_latency(model, batch_sizes=batch_sizes, input_len=input_len, output_len=32,
                         iterations=iterations, options=options)
    return {row["batch_size"]: row["batch_size"] * 1000.0
            / row["engine"]["decode_ms_per_token"] for row in result["rows"]}


def kv_quality(model: Transformer, tokens: np.ndarray, args: argparse.Namespace
               ) -> dict[str, Any]:
    """PPL per KV dtype and context, bytes per token, pool capacity, and the streamed rows."""
    config = model.config
    pool_bytes = args.pool_mib * 2 ** 20
    rows = []
    for name in DTYPES:
        ppl = {context: perplexity(model, tokens, window=context, batch_size=4,
                                   kv_cache_dtype=name).ppl for context in args.contexts}
        per_token = kv_bytes_per_token(config, None if name == "float32" else name)
        residual = (kivi_residual_bytes(config.num_cache_layers, config.num_kv_heads,
                                        config.head_dim, 16, 1) if name in KIVI_BITS else 0)
        rows.append({"name": name, "ppl": ppl, "bytes_per_token": per_token,
                     "residual_bytes_per_sequence": residual,
                     "max_sequences": max_sequences(pool_bytes, per_token, residual)})
        log(f"KV {name}: PPL {ppl}, {per_token} bytes/token")
    windows = tokens[:args.stream_windows * 256].reshape(args.stream_windows, 256)  # [B, T]
    float_nll, count = streamed_nll(model, windows, "float32", 16, 128)
    streamed = []
    for name in ("int4", "int2"):
        for page_size in args.stream_pages:
            nll, _ = streamed_nll(model, windows, name, page_size, 128)
            streamed.append({"name": name, "page_size": page_size,
                             "ratio": math.exp(nll / count) / math.exp(float_nll / count)})
            log(f"streamed {name} page {page_size}: {streamed[-1]['ratio']:.4f}x")
    return {"rows": rows, "streamed": streamed, "streamed_tokens": count,
            "float_streamed_ppl": math.exp(float_nll / count)}


def weight_quality(model_name: str, tokens: np.ndarray) -> list[dict[str, Any]]:
    """PPL (256-token windows) and block linear weight bytes per weight format."""
    rows = []
    for name in WEIGHT_FORMATS:
        model = weight_variant(name, model_name)
        stored, bf16 = linear_weight_bytes(model, r"^layers\.")
        rows.append({"name": name, "ppl": perplexity(model, tokens, window=256).ppl,
                     "linear_bytes": stored, "linear_bf16_bytes": bf16})
        log(f"weights {name}: PPL {rows[-1]['ppl']:.3f}, {stored:,} bytes")
    return rows


def low_bit_markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    quality = results["kv"]
    base = quality["rows"][0]
    contexts = args.contexts
    lines = [f"## Low-bit KV caches: quality, size, capacity, decode speed ({args.model})", "",
             f"Held-out Python-docs text ({args.ppl_tokens} tokens per context, disjoint "
             "windows, each one prefill through the engine's paged path, pages of 16). The "
             "demo was trained at 1024 positions: at 2048 RoPE extrapolates for every dtype, "
             "so compare the ratios. Bytes per token: K and V of every layer with scales and "
             "zero points; KIVI also holds a float32 residual page per running sequence "
             f"(counted in the capacity column: {SEQUENCE_TOKENS}-token sequences in a "
             f"{args.pool_mib} MiB pool). Decode: batch {args.decode_batch}, "
             f"{args.decode_context}-token prompts, 32 greedy tokens, timed phase below.", "",
             "| KV dtype | " + " | ".join(f"PPL @ {c} | / fp32" for c in contexts)
             + " | bytes / token | / fp32 | residual bytes / seq | 2k seqs in pool | "
             f"decode tok/s @ {args.decode_batch} | / fp32 |",
             "| --- | " + " | ".join("---: | ---:" for _ in contexts)
             + " | ---: | ---: | ---: | ---: | ---: | ---: |"]
    decode = results["kv_decode"]
    for row in quality["rows"]:
        cells = " | ".join(f"{row['ppl'][c]:.3f} | {row['ppl'][c] / base['ppl'][c]:.4f}"
                           for c in contexts)
        lines.append(f"| {row['name']} | {cells} | {row['bytes_per_token']:,.0f} | "
                     f"{row['bytes_per_token'] / base['bytes_per_token']:.3f} | "
                     f"{row['residual_bytes_per_sequence']:,} | {row['max_sequences']} | "
                     f"{decode[row['name']]:.0f} | "
                     f"{decode[row['name']] / decode['float32']:.2f} |")
    targets = {"int8": 1.01, "fp8_e4m3": 1.01, "int4": 1.03}
    verdicts = []
    for row in quality["rows"]:
        if row["name"] in targets:
            worst = max(row["ppl"][c] / base["ppl"][c] for c in contexts)
            verdicts.append(f"{row['name']} {worst:.4f}x (target <= {targets[row['name']]}x: "
                            f"{'met' if worst <= targets[row['name']] else 'not met'})")
    lines += ["", "Worst ratio over the contexts: " + "; ".join(verdicts) + ".", "",
              f"KIVI's residual window, streamed decode ({args.stream_windows} windows of 256 "
              "tokens: 128 prefilled, the rest fed one token per step and scored as decoded, "
              "so a query sees its own partial page exact, as in serving; the page is the key "
              "group and the window: the newest kv_len % page tokens stay exact). Ratio to "
              f"the same stream with a float cache (PPL {quality['float_streamed_ppl']:.3f}, "
              f"{quality['streamed_tokens']} tokens):", "",
              "| KV dtype | page (group, residual) | streamed PPL / float |",
              "| --- | ---: | ---: |"]
    lines += [f"| {entry['name']} | {entry['page_size']} | {entry['ratio']:.4f} |"
              for entry in quality["streamed"]]
    return "\n".join(lines)


def weights_markdown(results: dict[str, Any]) -> str:
    rows = results["weights"]
    base = rows[0]
    speeds = results["weight_decode"]
    sizes = list(speeds[base["name"]])
    lines = ["## FP8 weights (e4m3, one float32 scale per output channel)", "",
             "Every block linear weight quantized (the embedding and the LM head stay fp32); "
             "held-out PPL over disjoint 256-token windows; bytes of the blocks' linear "
             "weights (values and scales).", "",
             "| weights | PPL | / fp32 | block linear bytes | / bf16 | "
             + " | ".join(f"decode tok/s @ {size}" for size in sizes) + " |",
             "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in sizes) + " |"]
    for row in rows:
        lines.append(f"| {row['name']} | {row['ppl']:.3f} | {row['ppl'] / base['ppl']:.4f} | "
                     f"{row['linear_bytes']:,} | "
                     f"{row['linear_bytes'] / row['linear_bf16_bytes']:.3f} | "
                     + " | ".join(f"{speeds[row['name']][size]:.0f}" for size in sizes) + " |")
    fp8 = rows[WEIGHT_FORMATS.index("fp8 e4m3 per channel")]
    ratio = fp8["ppl"] / base["ppl"]
    lines += ["", f"FP8 weights: PPL {ratio:.4f}x fp32 (target <= 1.01x: "
              f"{'met' if ratio <= 1.01 else 'not met'}) at "
              f"{fp8['linear_bytes'] / fp8['linear_bf16_bytes']:.3f}x the bf16 bytes."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:demo")
    parser.add_argument("--corpus", default="data/corpus",
                        help="corpus directory (built from python3.11-doc if missing)")
    parser.add_argument("--contexts", type=lambda text: tuple(map(int, text.split(","))),
                        default=(512, 2048))
    parser.add_argument("--ppl-tokens", type=int, default=8192)
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--stream-windows", type=int, default=4)
    parser.add_argument("--stream-pages", type=lambda text: tuple(map(int, text.split(","))),
                        default=(16, 64))
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--skip-host-tier", action="store_true")
    parser.add_argument("--host-small", action="store_true",
                        help="the host tier's --small workload (a check, not the acceptance run)")
    parser.add_argument("--max-load", type=float, default=0.5)
    parser.add_argument("--quiet-timeout", type=float, default=3600.0)
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/kv_memory.md"))
    args = parser.parse_args(argv)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])])
    started = time.time()
    model = load_model(args.model)
    tokens = validation_tokens(Path(args.corpus), args.model, args.ppl_tokens + 1)
    results: dict[str, Any] = {"machine": machine_info()}
    results["kv"] = kv_quality(model, tokens, args)
    results["weights"] = weight_quality(args.model, tokens)
    log("quality figures done; the timed phase waits for a quiet machine")
    out = Path(args.out)
    for section in ("how-measured", "low-bit-kv", "fp8-weights"):  # ahead of the host tier's
        replace_section(out, section, f"(section {section}: being measured)", title=TITLE)
    with quiet_phase(args.max_load, args.quiet_timeout) as record:
        results["kv_decode"] = {}
        for name in DTYPES:
            results["kv_decode"][name] = decode_rates(
                model, (args.decode_batch,), args.decode_context,
                None if name == "float32" else name, args.iterations)[args.decode_batch]
            log(f"decode {name}: {results['kv_decode'][name]:.0f} tok/s")
        results["weight_decode"] = {}
        for name in WEIGHT_FORMATS:
            results["weight_decode"][name] = decode_rates(
                weight_variant(name, args.model), (1, 32), 32, None, args.iterations)
            log(f"decode {name}: {results['weight_decode'][name]}")
        if not args.skip_host_tier:
            host_status = kv_offload.main(["--model", args.model, "--out", args.out]
                                          + (["--small"] if args.host_small else []))
    results["timed_phase"] = record
    machine = results["machine"]
    header = "\n".join([
        f"## How these were measured ({machine['date']})", "",
        f"- Command: `{command}` (the host tier's section below is written by "
        "`benchmarks/kv_offload.py`, called by it inside the same timed phase)",
        f"- Machine: {machine['platform']}, {machine['cpu_count']} CPUs (shared), Python "
        f"{machine['python']}, jax {machine['jax']} ({machine['jax_backend']}), git "
        f"{machine['git']}; the run took {(time.time() - started) / 60:.0f} minutes.",
        f"- {describe(record)}"])
    replace_section(out, "how-measured", header, title=TITLE)
    replace_section(out, "low-bit-kv", low_bit_markdown(results, args), title=TITLE)
    replace_section(out, "fp8-weights", weights_markdown(results), title=TITLE)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    print(out.read_text())
    return 0 if args.skip_host_tier else host_status


if __name__ == "__main__":
    sys.exit(main())
