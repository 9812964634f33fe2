"""Quantization report: every format side by side on the demo teacher, in one run.

    python benchmarks/quantization_report.py --out benchmarks/results/quantization.md

For fp32 (the checkpoint), bf16, int8 RTN, int4 RTN and GPTQ (groups 128 and 32), 3-bit RTN
and GPTQ, W8A8 SmoothQuant and an int8 KV cache:

- validation PPL on held-out Python-docs text (the demo's own validation split, built by
  `train_distill.corpus`; disjoint 256-token windows, as `benchmarks/demo_models.py` scores
  the teacher) and its ratio to fp32;
- weight bytes of the blocks' linear layers (values + scales + zero points) and their ratio
  to the same weights in bf16, and the bytes of all parameters (the embedding and the LM
  head stay fp32 in every quantized row);
- KV-cache bytes per token (K and V of every layer, scales included);
- engine decode tokens/s at batch 1 and 32 (`jaxinfer.bench.latency`: greedy, 32-token
  prompts, (t(N) - t(1)) / (N - 1) per step) on this CPU.

GPTQ and SmoothQuant calibrate on the first `--calib-tokens` tokens of the training split
(never the validation text). Needs Debian's python3.11-doc (the corpus source).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxinfer.bench.latency import run_latency
from jaxinfer.bench.throughput import machine_info
from jaxinfer.model_loading import load_model, resolve_model_path
from jaxinfer.models import Transformer
from jaxinfer.perplexity import perplexity
from jaxinfer.quant import QuantizationConfig, linear_weight_bytes
from jaxinfer.quant.kv_cache import kv_bytes_per_token
from jaxinfer.quant.methods import apply_method, calibration_windows
from jaxinfer.tokenizer import load_tokenizer
from train_distill.corpus import build_corpus, read_documents
from train_distill.data import tokenize_split

# The projections the quantized rows quantize; the LM head stays fp32 in every row.
BLOCK_LINEARS = r"^layers\."


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row: how the model is made and how its KV cache is stored."""

    name: str
    method: str | None = None  # None: the float checkpoint
    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    dtype: str | None = None  # float variants: parameter and compute dtype
    kv_cache_dtype: str | None = None  # None: the compute dtype
    # GPTQ stores the same format as RTN at the same bits and group size, so the engine
    # runs the identical program: its decode speed is that variant's, not re-measured.
    decode_as: str | None = None


VARIANTS = (
    Variant("fp32 (checkpoint)"),
    Variant("bf16", dtype="bfloat16"),
    Variant("int8 RTN (per channel)", "rtn", 8),
    Variant("int4 RTN g128", "rtn", 4, 128, symmetric=False),
    Variant("int4 GPTQ g128", "gptq", 4, 128, symmetric=False, decode_as="int4 RTN g128"),
    Variant("int4 RTN g32", "rtn", 4, 32, symmetric=False),
    Variant("int4 GPTQ g32", "gptq", 4, 32, symmetric=False, decode_as="int4 RTN g32"),
    Variant("3-bit RTN g32", "rtn", 3, 32, symmetric=False, decode_as="int4 RTN g32"),
    Variant("3-bit GPTQ g32", "gptq", 3, 32, symmetric=False, decode_as="int4 RTN g32"),
    Variant("W8A8 SmoothQuant (a=0.5)", "smoothquant", 8),
    Variant("int8 KV cache (fp32 weights)", kv_cache_dtype="int8"),
)


def parameter_bytes(model: Transformer) -> int:
    """Bytes of every array of the model's state."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(model)))


def decode_tokens_per_second(model: Transformer, batch_sizes: tuple[int, ...],
                             kv_cache_dtype: str | None, iterations: int) -> dict[int, float]:
    """Engine decode tokens/s per batch size: B * 1000 / (ms per decode step)."""
    options = dict(max_num_seqs=max(batch_sizes), min_token_bucket=1,
                   max_num_batched_tokens=max(max(batch_sizes), 32), bucket_growth=8,
                   kv_cache_dtype=kv_cache_dtype)
    result = run_latency(model, batch_sizes=batch_sizes, input_len=32, output_len=32,
                         iterations=iterations, options=options)
    return {row["batch_size"]: row["batch_size"] * 1000.0
            / row["engine"]["decode_ms_per_token"] for row in result["rows"]}


def build_variant(variant: Variant, model_name: str, windows: np.ndarray) -> Transformer:
    if variant.method is None:
        overrides = {} if variant.dtype is None else {"dtype": variant.dtype,
                                                      "param_dtype": variant.dtype}
        return load_model(model_name, **overrides)
    config = QuantizationConfig.for_method(variant.method, bits=variant.bits,
                                           group_size=variant.group_size,
                                           symmetric=variant.symmetric)
    return apply_method(load_model(model_name), config, windows)


def corpus_tokens(corpus: Path, model_name: str, ppl_tokens: int, calib_tokens: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """`(validation stream [ppl_tokens + 1], calibration windows [B, 256])`."""
    if not (corpus / "validation.txt").is_file():
        build_corpus(corpus, ["python-docs"])
    tokenizer = load_tokenizer(resolve_model_path(model_name))
    validation = tokenize_split(corpus, "validation", tokenizer)[:ppl_tokens + 1]
    stream: list[int] = []
    for document in read_documents(corpus / "train.txt"):
        stream += [tokenizer.bos_token_id,
                   *tokenizer.encode(document, add_special_tokens=False),
                   tokenizer.eos_token_ids[0]]
        if len(stream) >= calib_tokens:
            break
    return validation, calibration_windows(stream, 256, calib_tokens)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    validation, windows = corpus_tokens(Path(args.corpus), args.model, args.ppl_tokens,
                                        args.calib_tokens)
    batch_sizes = tuple(int(size) for size in args.batch_sizes.split(","))
    rows = []
    for variant in VARIANTS:
        if args.only and not any(part in variant.name for part in args.only):
            continue
        started = time.perf_counter()
        model = build_variant(variant, args.model, windows)
        build_s = time.perf_counter() - started
        result = perplexity(model, validation, window=256, kv_cache_dtype=variant.kv_cache_dtype)
        stored, bf16 = linear_weight_bytes(model, BLOCK_LINEARS)
        row = {"name": variant.name, "ppl": result.ppl, "tokens": result.tokens,
               "build_s": build_s, "linear_bytes": stored, "linear_bf16_bytes": bf16,
               "parameter_bytes": parameter_bytes(model),
               "kv_bytes_per_token": kv_bytes_per_token(model.config,
                                                        variant.kv_cache_dtype)}
        measured = {done["name"]: done for done in rows}
        if variant.decode_as in measured and "decode_tokens_per_s" in measured[
                variant.decode_as]:
            row["decode_tokens_per_s"] = measured[variant.decode_as]["decode_tokens_per_s"]
            row["decode_as"] = variant.decode_as
        elif not args.skip_decode:
            row["decode_tokens_per_s"] = decode_tokens_per_second(
                model, batch_sizes, variant.kv_cache_dtype, args.iterations)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "batch_sizes": batch_sizes, "calib_windows": list(windows.shape),
            "machine": machine_info()}


def markdown(results: dict[str, Any], command: str) -> str:
    rows = results["rows"]
    base = next(row for row in rows if row["name"].startswith("fp32"))
    bf16_kv = next((row["kv_bytes_per_token"] for row in rows if row["name"] == "bf16"), None)
    sizes = results["batch_sizes"]
    machine = results["machine"]
    lines = [
        "# Quantization on the demo teacher",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine['platform']}, {machine['cpu_count']} CPUs (shared), Python "
        f"{machine['python']}, jax {machine['jax']} ({machine['jax_backend']}), git "
        f"{machine['git']}",
        f"- Date: {machine['date']}",
        "- Model: `builtin:demo` (8.4M parameters, 8 layers, D=256, 8 heads / 4 KV heads of "
        "32, MLP 768, vocab 4096, fp32).",
        f"- Validation: {base['tokens']} scored tokens of the held-out Python-docs split, "
        "disjoint 256-token windows. Calibration (GPTQ, SmoothQuant): "
        f"{results['calib_windows'][0]} x {results['calib_windows'][1]} tokens of the "
        "training split. Asymmetric (zero-point) groups for 4 and 3 bits; GPTQ with act-order, "
        "damping 0.01, blocks of 128. The embedding and the LM head stay fp32 in every row.",
        "",
        "| variant | val PPL | PPL / fp32 | block linear weight bytes | / bf16 "
        "| all parameter bytes | KV bytes / token | "
        + " | ".join(f"decode tok/s @ {size}" for size in sizes) + " | build s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in sizes) + " | ---: |",
    ]
    for row in rows:
        speeds = {int(size): speed for size, speed in row.get("decode_tokens_per_s",
                                                                {}).items()}
        kv = f"{row['kv_bytes_per_token']:,}"
        if bf16_kv and row["name"] != "bf16" and row["kv_bytes_per_token"] != bf16_kv:
            kv += f" ({row['kv_bytes_per_token'] / bf16_kv:.2f}x bf16)"
        lines.append(
            f"| {row['name']} | {row['ppl']:.3f} | {row['ppl'] / base['ppl']:.4f} | "
            f"{row['linear_bytes']:,} | {row['linear_bytes'] / row['linear_bf16_bytes']:.3f} | "
            f"{row['parameter_bytes']:,} | {kv} | "
            + " | ".join((f"{speeds[size]:.0f}" + ("*" if "decode_as" in row else ""))
                         if size in speeds else "-" for size in sizes)
            + f" | {row['build_s']:.1f} |")
    lines += ["", "\\* Same stored format as the RTN row of that width and group size, so the "
              "engine runs the identical program; its measured speed is repeated, not "
              "re-measured."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:demo")
    parser.add_argument("--corpus", default="data/corpus",
                        help="corpus directory (built from python3.11-doc if missing)")
    parser.add_argument("--ppl-tokens", type=int, default=32768)
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--only", action="append", help="variants whose name contains this")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--out", default="benchmarks/results/quantization.md")
    args = parser.parse_args(argv)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])])
    results = measure(args)
    text = markdown(results, command)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(text)
    print(f"python {platform.python_version()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
