"""Per-chip memory arithmetic for serving the issue's reference models on TPU and GPU slices.

    python benchmarks/memory_plan.py [--out benchmarks/results/scale.md]

For Llama-2-7B, Llama-2-70B and Mixtral-8x7B on v5e-8, v5p-8, v5p-16 (two hosts) and an
8 x H100 host, with bf16 and int8 weights and KV: weights per chip, KV bytes per token per
chip, and the tokens of context the remaining memory holds (10% of each chip kept for
activations and programs), at the smallest tensor-parallel size that fits and at the whole
slice. Arithmetic only (`jaxinfer.memory_plan`); nothing is run on the chips.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import replace_section

from jaxinfer.config import get_preset
from jaxinfer.memory_plan import ACCELERATORS, GIB, parameter_count, plan

TITLE = "Scale: tensor, data and expert parallel serving"

MODELS = ("llama-2-7b", "llama-2-70b", "mixtral-8x7b")
SLICES = ("v5e-8", "v5p-8", "v5p-16", "h100x8")
FORMATS = (("bf16", "bf16"), ("int8", "int8"))


def table() -> str:
    """The markdown table, one row per (model, slice, format, tensor-parallel size)."""
    lines = ["| model | params | slice | weights / KV | TP | weights GiB / chip | "
             "KV KiB / token / chip | context tokens / replica | replicas |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for name in MODELS:
        config = get_preset(name)
        for slice_name in SLICES:
            accelerator = ACCELERATORS[slice_name]
            for weight_format, kv_format in FORMATS:
                sizes = [tp for tp in (1, 2, 4, 8) if tp <= accelerator.chips
                         and accelerator.chips % tp == 0 and config.num_heads % tp == 0]
                plans = {tp: plan(config, accelerator, tensor_parallel=tp,
                                  weight_format=weight_format, kv_format=kv_format)
                         for tp in sizes}
                fitting = [tp for tp in sizes if plans[tp].fits]
                shown = sorted({fitting[0], sizes[-1]}) if fitting else [sizes[-1]]
                for tp in shown:
                    result = plans[tp]
                    tokens = (f"{result.max_context_tokens:,}" if result.fits
                              else "does not fit")
                    lines.append(
                        f"| {name} | {parameter_count(config) / 1e9:.1f}B | {slice_name} | "
                        f"{weight_format} / {kv_format} | {tp} | "
                        f"{result.weights_per_chip / GIB:.1f} | "
                        f"{result.kv_bytes_per_token / 1024:.0f} | {tokens} | "
                        f"{accelerator.chips // tp if result.fits else 0} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Prints the table; with `--out`, also writes it under a heading."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="markdown file to write")
    arguments = parser.parse_args(argv)
    text = table()
    print(text)
    if arguments.out:
        replace_section(Path(arguments.out), "memory", (
            "## Memory per chip for the reference models (arithmetic)\n\n"
            "Reproduce: `python benchmarks/memory_plan.py --out "
            "benchmarks/results/scale.md` (`jaxinfer.memory_plan`; HBM per chip: v5e "
            "16 GiB, v5p 95 GiB, H100 80 GiB; 10% of each chip reserved; int8 weights keep "
            "the embedding and LM head in bf16; int8 KV has one f32 scale per token and "
            "head).\n\n" + text), title=TITLE)

if __name__ == "__main__":
    main()
