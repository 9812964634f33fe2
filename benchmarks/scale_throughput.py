"""Engine throughput under tensor, data and expert parallel layouts on simulated devices.

    python benchmarks/scale_throughput.py [--devices 8] [--out benchmarks/results/scale.md]

A FUNCTIONAL CHECK, not a speed measurement: the devices are `--devices` host-platform CPU
devices that XLA simulates on this machine's cores, so splitting a model over more of them
adds collectives without adding compute. What the table shows is that every layout runs the
same workload to the same greedy tokens as one device, with no compilation after warm-up, and
what the simulation costs; speed-ups need real chips.

Each layout runs the same offline workload (`jaxinfer.bench.throughput.run_throughput`) on a
random dense model with 8 KV heads (so TP up to 8 keeps whole KV heads per device) and, for
EP, on a random Mixtral-style model with 8 experts. With `--out`, the table replaces the
"throughput" section of the results file and leaves its other sections (the memory
arithmetic of `benchmarks/memory_plan.py`) as they are.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = (  # (label, model, tensor, data, expert)
    ("1 device", "dense", 1, 1, 1),
    ("TP=2", "dense", 2, 1, 1),
    ("TP=4", "dense", 4, 1, 1),
    ("TP=8", "dense", 8, 1, 1),
    ("DP=2 x TP=4", "dense", 4, 2, 1),
    ("DP=8", "dense", 1, 8, 1),
    ("1 device (MoE)", "moe", 1, 1, 1),
    ("EP=4", "moe", 1, 1, 4),
    ("EP=4 x TP=2", "moe", 2, 1, 4),
)


def main(argv: list[str] | None = None) -> None:
    """Runs every layout and prints (and optionally writes) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", help="results markdown file whose section to replace")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from results_file import replace_section

    from jaxinfer.bench.throughput import run_throughput
    from jaxinfer.bench.workload import make_requests
    from jaxinfer.config import get_preset
    from jaxinfer.models import create_model

    base = get_preset("tiny").replace(vocab_size=2048, hidden_size=256, intermediate_size=512,
                                      num_layers=4, num_heads=16, num_kv_heads=8)
    models = {"dense": create_model(base, seed=0),
              "moe": create_model(base.replace(model_type="mixtral", num_experts=8,
                                               num_experts_per_token=2), seed=0)}
    requests = make_requests(args.num_prompts, vocab_size=base.vocab_size,
                             input_len=(16, 96), output_len=args.output_len, seed=0)
    rows, baseline = [], {}
    for label, kind, tensor, data, expert in LAYOUTS:
        options = dict(max_num_batched_tokens=256, max_num_seqs=16, min_token_bucket=16,
                       bucket_growth=4, tensor_parallel_size=tensor,
                       data_parallel_size=data, expert_parallel_size=expert)
        result = run_throughput(models[kind], requests, options)
        tokens = result["token_ids"]["engine"]
        baseline.setdefault(kind, (result, tokens))
        reference, reference_tokens = baseline[kind]
        same = sum(tokens[request.request_id] == reference_tokens[request.request_id]
                   for request in requests) / len(requests)
        engine, first = result["engine"], reference["engine"]
        rows.append(f"| {label} | {tensor * data * expert} | "
                    f"{engine['output_tokens_per_s']:.1f} | "
                    f"{engine['output_tokens_per_s'] / first['output_tokens_per_s']:.2f} | "
                    f"{engine['warm_up_s']:.1f} | {engine['compilations_during_run']} | "
                    f"{same:.0%} |")
        print(rows[-1], flush=True)
    table = "\n".join([
        "| layout | devices | output tok/s | vs 1 device | warm-up s | compiles in run | "
        "tokens equal to 1 device |",
        "|---|---:|---:|---:|---:|---:|---:|", *rows])
    text = (
        "## Simulated layouts: throughput (functional check on CPU)\n\n"
        f"**Functional check, not a speed result**: {args.devices} simulated CPU devices "
        f"share this machine's {os.cpu_count()} cores, so more devices add collectives and "
        "no compute; the point is that every layout serves the workload to the same greedy "
        "tokens with no compilation after warm-up.\n\n"
        f"Reproduce: `python benchmarks/scale_throughput.py --out "
        f"benchmarks/results/scale.md`. Machine: {platform.machine()}, {os.cpu_count()} "
        f"cores, {time.strftime('%Y-%m-%d')}. Workload: {args.num_prompts} requests, prompts "
        f"16-96 tokens, {args.output_len} output tokens each, greedy. Dense model: random "
        "4 layers, width 256, 16 heads / 8 KV heads, vocabulary 2048 (fp32); MoE model: the "
        "same with 8 experts, top-2. Engine: max 16 sequences, 256-token budget.\n\n"
        + table + "\n")
    print(text)
    if args.out:
        replace_section(Path(args.out), "throughput", text,
                        title="Scale: tensor, data and expert parallel serving")


if __name__ == "__main__":
    main()
