"""The `jaxinfer` command line.

    jaxinfer generate --model DIR (--prompt TEXT | --prompt-token-ids 1,2,3) [--max-tokens N]
                      [--temperature T] [--top-k K] [--top-p P] [--seed S] [--json]

With neither --prompt nor --prompt-token-ids the prompt text is read from stdin. With --json
one object `{"token_ids": [...], "text": "..."}` is printed for the generated part only;
`text` is null when the model directory has no tokenizer (then token ids are required).

    jaxinfer bench throughput --model random:bench-30m [--num-prompts 64]
                              [--input-len-range 64,256] [--output-len 128] [--compare-hf]
    jaxinfer bench latency --model random:bench-30m [--batch-size 1,16] [--input-len 32]
                           [--output-len 128] [--iterations 5] [--compare-hf]

Both print a markdown table; `--output-json PATH` writes the numbers and `--markdown PATH`
appends a report section (command, machine, date, numbers). See `jaxinfer.bench`. Both, and
`jaxinfer serve`, take `--config FILE`: a TOML or YAML file of their options by dest name
(`max_num_seqs = 64`); flags on the command line win over it (`add_config_argument`).

    jaxinfer quantize --model M --method rtn|gptq|smoothquant --bits 8|4|3 [--format F]
                      [--group-size G] [--asymmetric] [--calib FILE] --out DIR
    jaxinfer prune --model M --method magnitude|wanda|sparsegpt (--sparsity 0.5 | --pattern 2:4)
                   [--owl] [--bits 4 --group-size 128] --calib FILE [--num-windows N]
                   [--window W] --out DIR
    jaxinfer prune --model M --harp N [--harp-alpha search|FLOAT] --calib FILE --out DIR
    jaxinfer eval ppl --model M --data FILE [--window 256] [--stride S]
                      [--kv-cache-dtype int8] [--json]

`quantize` writes a quantized checkpoint (`jaxinfer.quant.checkpoint`) that every `--model`
flag, `LLM(model=DIR)` and `jaxinfer serve` load; GPTQ and SmoothQuant calibrate on the text
of `--calib`. `prune` writes a pruned float checkpoint (zeros in the blocks' linear
weights, a plain HF directory), or with `--bits` a quantized one from SparseGPT's joint pass;
with `--harp N` the top N layers lose their q/k projections and KV cache (HARP, alphas searched
on `--calib` or given), a checkpoint only our loader runs (`jaxinfer.prune.harp`);
all load like any other model. `eval ppl` prints the sliding-window perplexity of the text
in `--data`; with `--json`, one line `{"ppl": ..., "tokens": ...}`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxinfer.kv_formats import KV_CACHE_DTYPES


class CommandError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def _parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-token-ids {text!r}: expected comma-separated integers like 1,2,3"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-token-ids is empty")
    return ids


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="continue one prompt with a model",
                                   description="Continue one prompt with a model.")
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory, jaxinfer checkpoint, builtin:demo "
                             "or random:PRESET")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (default: read stdin)")
    prompt.add_argument("--prompt-token-ids", type=_parse_token_ids,
                        help="prompt as comma-separated token ids; needs no tokenizer")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 disables top-p")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameter and compute dtype (default: the checkpoint's)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    # Imported here so that `jaxinfer --help` answers without initializing jax.
    from jaxinfer.generate import SamplingConfig, generate
    from jaxinfer.model_loading import dtype_overrides, load_model, resolve_model_path
    from jaxinfer.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(resolve_model_path(args.model))
    except FileNotFoundError:
        tokenizer = None
    if args.prompt_token_ids is not None:
        prompt_ids = args.prompt_token_ids
    else:
        text = args.prompt if args.prompt is not None else sys.stdin.read()
        if tokenizer is None:
            raise CommandError(f"{args.model} has no tokenizer files (tokenizer.json or "
                               f"tokenizer.model): pass --prompt-token-ids instead of text")
        if not text:
            raise CommandError("the prompt is empty (give --prompt, --prompt-token-ids or "
                               "text on stdin)")
        prompt_ids = tokenizer.encode(text)

    overrides = dtype_overrides(args.dtype)
    try:
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
        model = load_model(args.model, **overrides)
        eos = () if args.ignore_eos else None  # None: the model's generation_config EOS
        [token_ids] = generate(model, [prompt_ids], max_new_tokens=args.max_tokens,
                               sampling=sampling, eos_token_ids=eos)
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise CommandError(str(error)) from None

    text = tokenizer.decode(token_ids) if tokenizer is not None else None
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text}, ensure_ascii=False))
    else:
        print(text if text is not None else " ".join(map(str, token_ids)))
    return 0


def _length(text: str) -> int | tuple[int, int]:
    from jaxinfer.bench.workload import parse_length

    try:
        return parse_length(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _batch_sizes(text: str) -> tuple[int, ...]:
    from jaxinfer.bench.latency import parse_batch_sizes

    try:
        return parse_batch_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _peers(text: str) -> tuple[str, ...]:
    """`--compare`'s value: a comma-separated subset of hf, vllm."""
    peers = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(set(peers) - {"hf", "vllm"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peers {unknown}: choose from hf, vllm")
    return peers


def _add_bench_common(parser: argparse.ArgumentParser,
                      engine_defaults: Mapping[str, Any]) -> None:
    """Model, engine and report flags both benchmarks take. The engine flags are
    `jaxinfer serve`'s (one builder, `add_engine_arguments`), less the two the benchmark sets
    itself, `max_model_len` (from the workload) and `enable_prompt_logprobs` (off), and the
    request limits (the benchmark's own requests are within them)."""
    import dataclasses

    from jaxinfer.engine.config import add_engine_arguments
    from jaxinfer.engine.limits import RequestLimits

    model = parser.add_argument_group("model")
    model.add_argument("--model", default="random:bench-30m",
                       help="HF checkpoint directory, jaxinfer checkpoint, builtin:demo or "
                            "random:PRESET (default: random:bench-30m)")
    for flag, what in (("--vocab-size", "vocabulary"), ("--hidden-size", "model width"),
                       ("--num-layers", "decoder blocks"), ("--num-heads", "query heads"),
                       ("--num-kv-heads", "key/value heads"),
                       ("--intermediate-size", "MLP width")):
        model.add_argument(flag, type=int, default=None,
                           help=f"{what} of a random:PRESET model (default: the preset's)")
    model.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="parameter and compute dtype (default: the model's)")
    limits = tuple(field.name for field in dataclasses.fields(RequestLimits))
    add_engine_arguments(parser, engine_defaults,
                         exclude=("max_model_len", "enable_prompt_logprobs", *limits))
    peer = parser.add_argument_group("comparison and reports")
    peer.add_argument("--compare", type=_peers, default=(), metavar="hf[,vllm]",
                      help="peers to run on the same requests and weights: hf (transformers "
                           "generate; needs the test extras) and, for throughput, vllm "
                           "(vLLM for CPU in its own environment: make vllm-env)")
    peer.add_argument("--compare-hf", action="store_true", help="the same as --compare hf")
    peer.add_argument("--hf-threads", type=int, default=None,
                      help="torch intra-op threads for the HF peer (default: torch's)")
    peer.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    peer.add_argument("--output-json", metavar="PATH", help="write the numbers as JSON")
    peer.add_argument("--markdown", metavar="PATH", help="append a markdown report section")
    add_config_argument(parser)


def _add_bench(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    # Neither module imports jax at module level, so `jaxinfer --help` stays fast.
    from jaxinfer.bench.latency import LATENCY_DEFAULTS
    from jaxinfer.engine.config import BENCH_DEFAULTS

    bench = subparsers.add_parser("bench", help="benchmark the engine (throughput, latency)",
                                  description="Benchmark the engine, optionally against HF "
                                              "transformers on the same weights.")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    throughput = kinds.add_parser(
        "throughput", help="offline throughput: every request submitted at once",
        description="Offline throughput: every request submitted at once, greedy, exactly "
                    "--output-len tokens each.")
    throughput.add_argument("--num-prompts", type=int, default=64, help="number of requests")
    throughput.add_argument("--input-len-range", type=_length, default=(64, 256),
                            metavar="N|LOW,HIGH", help="prompt length or inclusive range")
    throughput.add_argument("--output-len", type=_length, default=128, metavar="N|LOW,HIGH",
                            help="output length or inclusive range")
    throughput.add_argument("--hf-batch-size", type=int, default=16,
                            help="HF static batch size")
    throughput.add_argument("--no-roofline", action="store_true",
                            help="skip timing prefill and decode steps against the machine's "
                                 "measured roofline after the run")
    _add_bench_common(throughput, BENCH_DEFAULTS)
    throughput.set_defaults(handler=_run_bench)
    latency = kinds.add_parser(
        "latency", help="decode latency at fixed batch sizes",
        description="Per-output-token decode latency, (t(N) - t(1)) / (N - 1), and "
                    "end-to-end latency at fixed batch sizes. Unless given, --max-num-seqs "
                    "is the largest batch and --max-num-batched-tokens holds one prompt and "
                    "a decode of every request.")
    latency.add_argument("--batch-size", type=_batch_sizes, default=(1, 16), metavar="B[,B]",
                         help="batch sizes (default: 1,16)")
    latency.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    latency.add_argument("--output-len", type=int, default=128, help="generated tokens")
    latency.add_argument("--iterations", type=int, default=5, help="timed runs (median)")
    _add_bench_common(latency, LATENCY_DEFAULTS)
    latency.set_defaults(handler=_run_bench)
    return kinds


def _run_bench(args: argparse.Namespace) -> int:
    # Imported here so that `jaxinfer --help` answers without initializing jax or torch.
    from jaxinfer.bench import hf_peer, latency, throughput, vllm_peer
    from jaxinfer.bench.workload import make_requests
    from jaxinfer.engine.config import engine_options_from_args
    from jaxinfer.model_loading import dtype_overrides

    compare_hf = args.compare_hf or "hf" in args.compare
    compare_vllm = "vllm" in args.compare
    try:
        if compare_vllm and args.bench_command != "throughput":
            raise ValueError("--compare vllm is for bench throughput")
        if compare_hf:  # fail now, not after the engine run
            hf_peer.require_transformers()
        if compare_vllm:
            vllm_peer.vllm_python()
        dtype = args.dtype
        model = throughput.load_bench_model(
            args.model, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
            num_layers=args.num_layers, num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
            **dtype_overrides(dtype))
        options = engine_options_from_args(args)
        if args.bench_command == "throughput":
            requests = make_requests(args.num_prompts, vocab_size=model.config.vocab_size,
                                     input_len=args.input_len_range,
                                     output_len=args.output_len, seed=args.seed)
            result = throughput.run_throughput(model, requests, options,
                                               compare_hf=compare_hf,
                                               hf_batch_size=args.hf_batch_size,
                                               hf_threads=args.hf_threads,
                                               roofline=not args.no_roofline,
                                               compare_vllm=compare_vllm)
            table, title = throughput.throughput_table(result), "jaxinfer bench throughput"
        else:
            result = latency.run_latency(
                model, batch_sizes=args.batch_size, input_len=args.input_len,
                output_len=args.output_len, iterations=args.iterations, options=options,
                compare_hf=compare_hf, hf_threads=args.hf_threads, seed=args.seed)
            table, title = latency.latency_table(result), "jaxinfer bench latency"
    except (hf_peer.HFUnavailableError, vllm_peer.VLLMUnavailableError) as error:
        raise CommandError(str(error)) from None
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise CommandError(str(error)) from None
    result["model"] = throughput.describe_model(model, args.model)
    result["command"] = throughput.command_line(args.argv)
    result["machine"] = throughput.machine_info()
    print(table)
    if args.output_json:
        throughput.write_json(args.output_json, result)
    if args.markdown:
        throughput.append_markdown(args.markdown, title, result, table)
    return 0


def _add_quantize(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quantize", help="write a quantized checkpoint (RTN, GPTQ or SmoothQuant)",
        description="Quantize a model's linear weights and write a checkpoint that "
                    "--model, LLM(model=DIR) and jaxinfer serve load directly. The "
                    "embedding table stays in floating point; the LM head as --head says.")
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory, jaxinfer checkpoint or builtin:demo")
    parser.add_argument("--method", choices=("rtn", "gptq", "smoothquant"), required=True,
                        help="round-to-nearest, GPTQ, or SmoothQuant W8A8")
    parser.add_argument("--bits", type=int, choices=(8, 4, 3), default=8,
                        help="8: int8 per output channel (W8A8 for smoothquant); 4 or 3: "
                             "group-wise in packed nibbles")
    # Not `choices=`: the format registry imports JAX, which building the parser does not.
    parser.add_argument("--format", dest="weight_format", default=None,
                        help="a registered weight format instead of the one --bits picks, "
                             "e.g. fp8 (e4m3 values, a scale per output channel)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="input rows per scale for 4 and 3 bits (default 128)")
    parser.add_argument("--asymmetric", action="store_true",
                        help="zero points per group (4 and 3 bits)")
    parser.add_argument("--head", choices=("auto", "float", "int8"), default="auto",
                        help="the LM head: float (the papers' protocol), int8 (groups of 32, "
                             "GGUF's Q8_0, round to nearest), or auto (default): int8 where "
                             "the head is tied to the embedding table (small models, whose "
                             "head is their largest matrix, as llama.cpp's files have it), "
                             "float otherwise")
    parser.add_argument("--calib", metavar="FILE",
                        help="calibration text (needed by gptq and smoothquant)")
    parser.add_argument("--calib-tokens", type=int, default=16384,
                        help="calibration tokens used (windows of --calib-window)")
    parser.add_argument("--calib-window", type=int, default=256,
                        help="tokens per calibration sequence")
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration "
                        "strength")
    parser.add_argument("--damping", type=float, default=0.01,
                        help="GPTQ damping, a fraction of the mean Hessian diagonal")
    parser.add_argument("--no-act-order", action="store_true",
                        help="GPTQ: process columns in their order, not by Hessian diagonal")
    parser.add_argument("--out", required=True, help="output directory")
    parser.set_defaults(handler=_run_quantize)


def _run_quantize(args: argparse.Namespace) -> int:
    from jaxinfer.model_loading import load_model, resolve_model_path
    from jaxinfer.quant.checkpoint import save_quantized_model
    from jaxinfer.quant.config import QuantizationConfig
    from jaxinfer.quant.methods import apply_method

    if args.method != "rtn" and args.calib is None:  # before loading the model
        raise CommandError(f"--method {args.method} calibrates on text: give --calib FILE")
    try:
        model = load_model(args.model)
        head = args.head
        if head == "auto":
            head = "int8" if model.config.tie_word_embeddings else "float"
        config = QuantizationConfig.for_method(
            args.method, bits=args.bits, group_size=args.group_size,
            symmetric=not args.asymmetric, weight_format=args.weight_format,
            head=head, smoothquant_alpha=args.alpha,
            gptq_damping=args.damping, gptq_act_order=not args.no_act_order)
        windows = None
        if args.method != "rtn":
            windows = _calibration_windows(args.model, args.calib, args.calib_window,
                                           args.calib_tokens)
        quantized = apply_method(model, config, windows)
        source = resolve_model_path(args.model)
        out = save_quantized_model(quantized, config, args.out,
                                   tokenizer_directory=source if source.is_dir() else None)
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise CommandError(str(error)) from None
    described = args.weight_format or f"{args.bits}-bit"
    print(f"wrote {args.method} {described} checkpoint to {out}")
    return 0


def _calibration_windows(model: str, calib: str, window: int, max_tokens: int) -> Any:
    """`[B, window]` calibration token ids from the start of the text file `calib`, tokenized
    with `model`'s tokenizer, at most `max_tokens` tokens (quantize and prune)."""
    from jaxinfer.model_loading import resolve_model_path
    from jaxinfer.quant.calibration import calibration_windows
    from jaxinfer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(model))
    text = Path(calib).read_text(encoding="utf-8")
    # Only the first max_tokens tokens are used; 16 characters a token is a generous bound,
    # so a large file is not tokenized whole.
    text = text[:16 * max_tokens]
    return calibration_windows(tokenizer.encode(text), window, max_tokens)


def _add_prune(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prune", help="write a pruned checkpoint (magnitude, Wanda, SparseGPT; structured)",
        description="Prune the blocks' linear weights in one shot, layer by layer on "
                    "calibration text, and write a checkpoint that --model, LLM(model=DIR) "
                    "and jaxinfer serve load directly: a float checkpoint with zeros, or with "
                    "--bits a quantized one (joint SparseGPT + quantization). The LM head and "
                    "the embedding stay dense. With --structured, whole KV groups (with their "
                    "query heads), MLP channels and layers are removed instead, by their "
                    "importance on the calibration text: a smaller dense model.")
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory, jaxinfer checkpoint or builtin:demo")
    parser.add_argument("--method", choices=("magnitude", "wanda", "sparsegpt"), default=None,
                        help="|W|, |W| times the input norm, or SparseGPT (survivors updated); "
                             "needed with --sparsity or --pattern")
    # One target: a sparsity or N:M pattern (masks), or structures to remove.
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--structured", metavar="SPEC",
                        help="remove structures, e.g. heads=0.25,mlp=0.3,layers=2: fractions "
                             "of KV groups and MLP channels per layer, and whole layers")
    target.add_argument("--sparsity", type=float,
                        help="fraction of every output's input weights zeroed, in [0, 1)")
    target.add_argument("--pattern", metavar="N:M",
                        help="zero the N lowest of every M consecutive inputs (2:4, 4:8)")
    target.add_argument("--harp", type=int, metavar="N",
                        help="HARP: the top N layers attend only to themselves (no q/k "
                             "projections, no KV cache), their attention scaled by alpha")
    parser.add_argument("--harp-alpha", default="search", metavar="search|FLOAT",
                        help="--harp: search each layer's alpha in 0, 0.1, ..., 1 on the "
                             "calibration text, top layer first (default), or one alpha in "
                             "[0, 1] for every layer (1: no rescaling)")
    parser.add_argument("--owl", action="store_true",
                        help="OWL: layers with more Wanda-score outliers pruned less "
                             "(sparsity +- --owl-lambda, mean --sparsity)")
    parser.add_argument("--owl-lambda", type=float, default=0.08,
                        help="OWL's largest change of a layer's sparsity")
    parser.add_argument("--bits", type=int, choices=(8, 4, 3, 2), default=None,
                        help="sparsegpt: also quantize the survivors in the same pass (8: "
                             "int8 per output channel; 4, 3, 2: group-wise nibbles)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="input rows per scale with --bits 4, 3, 2 (default 128)")
    parser.add_argument("--damping", type=float, default=0.01,
                        help="SparseGPT damping, a fraction of the mean Hessian diagonal")
    parser.add_argument("--importance", choices=("activation", "taylor"), default="activation",
                        help="--structured: activation norms and block influence (Minitron), "
                             "or |w * dL/dw| per structure")
    parser.add_argument("--calib", metavar="FILE", required=True, help="calibration text")
    parser.add_argument("--num-windows", type=int, default=64,
                        help="calibration sequences (of --window tokens) used at most")
    parser.add_argument("--window", type=int, default=256,
                        help="tokens per calibration sequence")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr")
    parser.add_argument("--out", required=True, help="output directory")
    parser.set_defaults(handler=_run_prune)


def _run_prune(args: argparse.Namespace) -> int:
    from checkpoints import save_hf_checkpoint
    from jaxinfer.model_loading import load_model, resolve_model_path
    from jaxinfer.prune import PruningConfig, parse_pattern, prune_model
    from jaxinfer.quant.checkpoint import save_quantized_model

    if args.structured is not None:
        return _run_structured_prune(args)
    if args.harp is not None:
        return _run_harp_prune(args)
    try:
        if args.method is None:
            raise CommandError("--sparsity and --pattern need --method")
        if args.bits is not None and args.method != "sparsegpt":
            raise CommandError("--bits quantizes in SparseGPT's pass: use --method sparsegpt")
        config = PruningConfig.for_method(
            args.method, sparsity=args.sparsity,
            pattern=None if args.pattern is None else parse_pattern(args.pattern),
            owl=args.owl, owl_lambda=args.owl_lambda, bits=args.bits,
            group_size=args.group_size, damping=args.damping)
        windows = _calibration_windows(args.model, args.calib, args.window,
                                       args.num_windows * args.window)
        model = load_model(args.model)
        pruned = prune_model(model, config, windows, progress=not args.no_progress)
        source = resolve_model_path(args.model)
        tokenizer_directory = source if source.is_dir() else None
        quantization = config.quantization_config()
        if quantization is None:
            out = save_hf_checkpoint(pruned, args.out, tokenizer_directory=tokenizer_directory)
        else:
            out = save_quantized_model(pruned, quantization, args.out,
                                       tokenizer_directory=tokenizer_directory)
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise CommandError(str(error)) from None
    target = f"{args.sparsity:g}" if args.pattern is None else args.pattern
    quantized = "" if args.bits is None else f" + {args.bits}-bit"
    print(f"wrote {args.method} {target}{' (OWL)' if args.owl else ''}{quantized} "
          f"checkpoint to {out}")
    return 0


def _run_structured_prune(args: argparse.Namespace) -> int:
    from checkpoints import save_hf_checkpoint
    from jaxinfer.memory_plan import parameter_count
    from jaxinfer.model_loading import load_model, resolve_model_path
    from jaxinfer.prune.structured import structured_prune

    if args.method is not None or args.bits is not None or args.owl:
        raise CommandError("--structured takes none of --method, --bits, --owl")
    try:
        windows = _calibration_windows(args.model, args.calib, args.window,
                                       args.num_windows * args.window)
        model = load_model(args.model)
        pruned = structured_prune(model, args.structured, windows, importance=args.importance)
        source = resolve_model_path(args.model)
        out = save_hf_checkpoint(pruned, args.out,
                                 tokenizer_directory=source if source.is_dir() else None)
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise CommandError(str(error)) from None
    before, after = parameter_count(model.config), parameter_count(pruned.config)
    print(f"wrote structured ({args.structured}, {args.importance} importance) checkpoint to "
          f"{out}: {after:,} parameters, {after / before:.1%} of {before:,}")
    return 0


def _harp_alpha(value: str) -> float | None:
    """`--harp-alpha`: None for "search", else the float in [0, 1]."""
    if value == "search":
        return None
    try:
        alpha = float(value)
    except ValueError:
        alpha = -1.0
    if not 0.0 <= alpha <= 1.0:
        raise CommandError(f"--harp-alpha {value!r}: 'search' or a number in [0, 1]")
    return alpha


def _run_harp_prune(args: argparse.Namespace) -> int:
    from checkpoints import save_hf_checkpoint
    from jaxinfer.model_loading import load_model, resolve_model_path
    from jaxinfer.prune.harp import harp_prune
    from jaxinfer.quant.kv_cache import kv_bytes_per_token

    if args.method is not None or args.bits is not None or args.owl:
        raise CommandError("--harp takes none of --method, --bits, --owl (prune or quantize "
                           "the HARP checkpoint in a second command)")
    alpha = _harp_alpha(args.harp_alpha)
    try:
        windows = None if alpha is not None else _calibration_windows(
            args.model, args.calib, args.window, args.num_windows * args.window)
        model = load_model(args.model)
        pruned, alphas = harp_prune(model, windows, args.harp, alpha,
                                    progress=not args.no_progress)
        source = resolve_model_path(args.model)
        out = save_hf_checkpoint(pruned, args.out,
                                 tokenizer_directory=source if source.is_dir() else None)
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise CommandError(str(error)) from None
    before, after = kv_bytes_per_token(model.config), kv_bytes_per_token(pruned.config)
    print(f"wrote HARP ({args.harp} layers, alphas {', '.join(f'{a:g}' for a in alphas)}) "
          f"checkpoint to {out}: KV cache {after} bytes per token, {after / before:.1%} "
          f"of {before}")
    return 0


def _add_eval(subparsers: argparse._SubParsersAction) -> None:
    evaluate = subparsers.add_parser("eval", help="evaluate a model (perplexity)",
                                     description="Evaluate a model.")
    kinds = evaluate.add_subparsers(dest="eval_command", required=True)
    parser = kinds.add_parser(
        "ppl", help="sliding-window perplexity on a text file",
        description="Perplexity of the model on the text of --data (tokenized with the "
                    "model's tokenizer, BOS first), windows of --window tokens every "
                    "--stride tokens; each token is scored once.")
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory, jaxinfer (or quantized) checkpoint, "
                             "builtin:demo")
    parser.add_argument("--data", required=True, metavar="FILE", help="text file")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--stride", type=int, default=None,
                        help="tokens between window starts (default: --window)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="score only the first N tokens of the text")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--kv-cache-dtype",
                        choices=("float32", "bfloat16", *KV_CACHE_DTYPES[1:]),
                        default=None,
                        help="score through a paged KV cache of this dtype, as the engine "
                             "runs (default: no cache, keys at compute precision)")
    parser.add_argument("--json", action="store_true",
                        help='print one line {"ppl": ..., "tokens": ...}')
    parser.set_defaults(handler=_run_eval_ppl)


def _run_eval_ppl(args: argparse.Namespace) -> int:
    from jaxinfer.model_loading import load_model, resolve_model_path
    from jaxinfer.perplexity import perplexity
    from jaxinfer.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(resolve_model_path(args.model))
        text = Path(args.data).read_text(encoding="utf-8")
        token_ids = tokenizer.encode(text)[:args.max_tokens]
        model = load_model(args.model)
        result = perplexity(model, token_ids, window=args.window, stride=args.stride,
                            batch_size=args.batch_size, kv_cache_dtype=args.kv_cache_dtype)
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise CommandError(str(error)) from None
    if args.json:
        print(json.dumps({"ppl": result.ppl, "tokens": result.tokens}))
    else:
        print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens")
    return 0


# ---------------------------------------------------------------------- --config FILE


class _ParseAgain(Exception):  # noqa: N818 (a signal to `parse_args`, not an error)
    """Raised by `--config` once its file's options are the command's defaults."""


class _ConfigFileAction(argparse.Action):
    """`--config FILE`: the file's options become the command's parser defaults, and the
    whole command line is parsed again (`parse_args`).

    Defaults rather than inserted flags give the order vLLM's `--config` has, command line >
    file > defaults, wherever `--config` stands among the flags; the file's values go through
    each flag's own type and choices.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        applied = parser.get_default(self.dest)
        if applied is None:
            try:
                defaults = config_file_defaults(parser, values)
            except ValueError as error:  # ConfigFileError: unknown key, bad value, bad file
                parser.error(str(error))
            for action in parser._actions:
                if action.dest in defaults:  # `--model` may come from the file
                    action.required = False
            parser.set_defaults(**defaults, **{self.dest: values})
            raise _ParseAgain
        if values != applied:
            parser.error(f"give one --config, not {applied} and {values}")
        setattr(namespace, self.dest, values)


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--config FILE` to a command: its options in a TOML or YAML file.

    The file's keys are the command's flags by dest name (`max_num_seqs = 64`,
    `http_port = 8080`, a `[speculative]` table; dashes work as underscores); an unknown key or
    a bad value is an argparse error naming the key and the file. Parse with `parse_args`.
    """
    parser.add_argument(
        "--config", metavar="FILE", action=_ConfigFileAction, default=None,
        help="read options from a TOML (.toml) or YAML (.yaml, .yml) file, by their dest "
             "names (max_num_seqs = 64); flags given here override the file")


def _config_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """{config file key (the dest name): action} of a command's parser."""
    return {action.dest: action for action in parser._actions
            if action.dest not in ("help", "config", argparse.SUPPRESS)
            and not isinstance(action, argparse._SubParsersAction)}


def config_file_defaults(parser: argparse.ArgumentParser,
                         path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's options as `parser`'s values, each through its flag's type and choices.

    Raises:
        ConfigFileError: The file cannot be read, or a key or a value is bad (naming both).
    """
    from jaxinfer.engine.config import ConfigFileError, check_config_keys, read_config_file

    options = read_config_file(path)
    actions = _config_actions(parser)
    check_config_keys(path, options, actions)
    defaults = {}
    for name, value in options.items():
        try:
            defaults[name] = _config_value(actions[name], value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            raise ConfigFileError(f"config file {path}: {name} = {value!r}: {error}") from None
    return defaults


def _config_value(action: argparse.Action, value: Any) -> Any:
    """A config file value as the flag would have stored it.

    A value is what would follow the flag: a number or a string, a list for a comma-separated
    or multi-value flag, a table for a JSON flag (`speculative`), true/false for a switch;
    null (YAML) stores None.
    """
    if action.nargs == 0:  # a switch: --flag / --no-flag, store_true
        if not isinstance(value, bool):
            raise ValueError("expected true or false")
        return value
    if value is None:
        return None
    if action.nargs in ("*", "+") or (isinstance(action.nargs, int) and action.nargs > 1):
        return [_config_item(action, item)
                for item in (value if isinstance(value, list) else [value])]
    return _config_item(action, value)


def _config_item(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, bool):  # str(True) would pass for a string flag
        raise ValueError("expected a value, not true/false")
    if isinstance(value, dict):
        text = json.dumps(value)
    elif isinstance(value, list):
        text = ",".join(str(item) for item in value)
    else:
        text = str(value)
    try:
        result = action.type(text) if callable(action.type) else text
    except ValueError:
        if action.type in (int, float):  # rather than int()'s "invalid literal for ..."
            raise ValueError("expected an integer" if action.type is int
                             else "expected a number") from None
        raise
    if action.choices is not None and result not in action.choices:
        raise ValueError(f"choose from {', '.join(map(repr, action.choices))}")
    return result


def parse_args(argv: Sequence[str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)` (default: `build_parser()`'s), with `--config` files read."""
    parser = parser or build_parser()
    try:
        return parser.parse_args(argv)
    except _ParseAgain:  # the command's parser now holds the file's options as defaults
        return parser.parse_args(argv)


def command_parser(*command: str, parser: argparse.ArgumentParser | None = None
                   ) -> argparse.ArgumentParser:
    """The parser of a (sub)command, e.g. `command_parser("bench", "latency")`.

    Raises:
        KeyError: No such command.
    """
    parser = parser or build_parser()
    for name in command:
        [subparsers] = [action for action in parser._actions
                        if isinstance(action, argparse._SubParsersAction)]
        parser = subparsers.choices[name]
    return parser


def config_file_keys(*command: str) -> frozenset[str]:
    """The keys `jaxinfer COMMAND --config FILE` takes (e.g. `config_file_keys("serve")`).

    Raises:
        KeyError: No such command.
    """
    return frozenset(_config_actions(command_parser(*command)))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="jaxinfer",
                                     description="JAX/XLA inference for Llama-family models.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    bench_kinds = _add_bench(subparsers)
    _add_quantize(subparsers)
    _add_prune(subparsers)
    _add_eval(subparsers)
    _add_plugins(subparsers, bench_kinds)
    return parser


# Packages that build on jaxinfer (serve: `jaxinfer serve`, `jaxinfer bench serve`) add their
# commands through this entry-point group, so jaxinfer itself never imports them. Each entry
# point is a function `register(subparsers, bench_subparsers)`.
PLUGIN_GROUP = "jaxinfer.cli"


def _add_plugins(subparsers: argparse._SubParsersAction,
                 bench_kinds: argparse._SubParsersAction) -> None:
    for entry_point in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP),
                              key=lambda entry: entry.name):
        entry_point.load()(subparsers, bench_kinds)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `jaxinfer` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    try:
        return args.handler(args)
    except CommandError as error:
        command = " ".join(filter(None, (args.command, getattr(args, "bench_command", None),
                                         getattr(args, "eval_command", None))))
        print(f"jaxinfer {command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m jaxinfer.cli`: run the module the plugins import (`jaxinfer.cli`), not this
    # `__main__` copy of it, whose classes (`--config`'s signal) would be others.
    from jaxinfer.cli import main as canonical_main

    sys.exit(canonical_main())
