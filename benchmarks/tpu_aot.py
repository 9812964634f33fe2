"""The serving step of real model sizes, compiled for TPU slices on a CPU machine.

    make tpu-env && .venv-tpu/bin/python benchmarks/tpu_aot.py [--out benchmarks/results/tpu_aot.md]

For each configuration (`CASES`: Llama-3-8B on v5e-8 and v5e-4, Llama-2-70B on v5p-16 and
v5e-16, Mixtral-8x7B with expert parallelism on v5p-8; bf16 and int8 weights), the engine's
jitted step is compiled ahead of time (`jaxinfer.engine.aot`) and the table reports:

- HBM per chip of the largest bucket's program at full depth: weights, KV pool, step inputs,
  temporaries and code, against the chip's HBM, and beside `jaxinfer.memory_plan`;
- the largest KV pool that fits, checked by the compiler: the program is compiled again with
  that many pages (it must compile) and with 5% more (the TPU compiler must refuse it for
  running out of HBM);
- estimated decode ms per step at batch 1/64/256 and prefill tokens/s, from the compiled
  programs' FLOPs and bytes and the chip's published peaks (estimates, not measurements);
- collectives per layer in the compiled HLO;
- compile time against depth (8/32/80 layers).

The engine's step scans over its stacked layers (`jaxinfer.models.scan`): one copy of the
block whatever the depth, so its compile time is flat in depth, and the compiler's cost
analysis of a loop does not tell one layer's share. Cost and collectives therefore come from
programs compiled with the layers unrolled (`scan_layers=False`) at 1 and 2 layers: the
layers are identical, so one layer's share is the difference and the rest is what the model
does once (embedding, LM head, sampler). The unrolled full-depth program's FLOPs check the
extrapolation. The attention kernel is a Mosaic custom call without a cost model: its KV
reads and FLOPs are added from the sizes (each sequence holding `CONTEXT` tokens). The bytes
term is what must cross HBM (weights, inputs, KV read, logits), not the compiler's `bytes
accessed`, which counts operand traffic per fusion (measured against one matmul in the run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import replace_section

from jaxinfer import memory_plan
from jaxinfer.engine import aot

TITLE = "TPU ahead-of-time compiles of the serving step"
CONTEXT = 1024  # tokens each decoding sequence holds, for the KV reads
DECODE_BATCHES = (1, 64, 256)
PREFILL_TOKENS = 2048
GROWTH = 1.05  # the pool that must not fit: 5% over the largest

# vLLM-TPU-like serving sizes: 256 sequences, a 2,048-token step, 4,096-token sequences.
OPTIONS = dict(max_num_seqs=256, max_num_batched_tokens=PREFILL_TOKENS, max_model_len=4096,
               page_size=16, min_token_bucket=8, enable_prompt_logprobs=False)

CASES = (
    aot.ServingCase(name="Llama-3-8B bf16, v5e-8 TP8", preset="llama-3-8b",
                    topology="v5e:2x4", tensor_parallel=8, options=OPTIONS),
    aot.ServingCase(name="Llama-3-8B int8, v5e-8 TP8", preset="llama-3-8b",
                    topology="v5e:2x4", tensor_parallel=8, weights="int8", options=OPTIONS),
    aot.ServingCase(name="Llama-3-8B int8, v5e-4 TP4", preset="llama-3-8b",
                    topology="v5e:2x2", tensor_parallel=4, weights="int8", options=OPTIONS),
    aot.ServingCase(name="Llama-3-8B int8 + int8 KV, v5e-4 TP4", preset="llama-3-8b",
                    topology="v5e:2x2", tensor_parallel=4, weights="int8",
                    kv_cache_dtype="int8", options=OPTIONS),
    aot.ServingCase(name="Llama-2-70B bf16, v5p-16 TP8", preset="llama-2-70b",
                    topology="v5p:2x2x2", tensor_parallel=8, options=OPTIONS),
    # A v5e-16 slice serves it as two TP8 replicas; one replica's program is compiled for
    # 8 chips (libtpu 0.0.42.1 rejects a program on 8 of a described 16-chip slice: "device_id
    # 11 ... target has 8 device_id").
    aot.ServingCase(name="Llama-2-70B int8, v5e-16 as 2 x TP8 (one replica)",
                    preset="llama-2-70b", topology="v5e:2x4", tensor_parallel=8,
                    weights="int8", options=OPTIONS),
    aot.ServingCase(name="Mixtral-8x7B bf16, v5p-8 EP2 x TP2", preset="mixtral-8x7b",
                    topology="v5p:2x2x1", tensor_parallel=2, expert_parallel=2,
                    options=OPTIONS),
    aot.ServingCase(name="Mixtral-8x7B int8 attention (experts bf16), v5p-8 EP2 x TP2",
                    preset="mixtral-8x7b",
                    topology="v5p:2x2x1", tensor_parallel=2, expert_parallel=2,
                    weights="int8", options=OPTIONS),
    aot.ServingCase(name="Llama-3-8B bf16 + Llama-3.2-1B drafter (R = 4), v5e-8 TP8",
                    preset="llama-3-8b", topology="v5e:2x4", tensor_parallel=8,
                    options=dict(OPTIONS, speculative={
                        "method": "draft_model", "model": "random:llama-3.2-1b",
                        "num_tokens": 4})),
)

DEPTH_CASE = CASES[4]  # compile time against depth: Llama-2-70B bf16 on v5p-16
DEPTHS = (8, 32, 80)


def _small(case: aot.ServingCase, layers: int) -> aot.ServingCase:
    """`case` at `layers` layers with the smallest pool (one sequence's pages), so the
    pool's bytes, which the compiler counts for the attention call, stay negligible."""
    pages = math.ceil(case.options["max_model_len"] / case.options["page_size"]) + 1
    return case.replace(num_layers=layers, options=dict(case.options, num_pages=pages))


@dataclasses.dataclass
class Linear:
    """A quantity as `fixed + layers * per_layer`."""

    fixed: float
    per_layer: float

    def at(self, layers: int) -> float:
        return self.fixed + layers * self.per_layer


def layer_costs(case: aot.ServingCase, num_tokens: int
                ) -> tuple[Linear, dict[str, Linear], int, float]:
    """One bucket's FLOPs and collectives as fixed + per-layer parts, its step-input bytes,
    and the compiler's bytes accessed at full depth (extrapolated likewise)."""
    one = aot.compile_step(aot.abstract_runner(_small(case, 1), scan_layers=False),
                           num_tokens)
    two = aot.compile_step(aot.abstract_runner(_small(case, 2), scan_layers=False),
                           num_tokens)

    def split(a: float, b: float) -> Linear:
        return Linear(2 * a - b, b - a)

    collectives = {op: split(one.collectives[op], two.collectives[op])
                   for op in aot.COLLECTIVES}
    inputs = one.argument_bytes - one.weight_bytes - one.pool_bytes
    accessed = split(one.bytes_accessed, two.bytes_accessed).at(case.model_config.num_layers)
    return split(one.flops, two.flops), collectives, inputs, accessed


def matmul_accounting(chip: str) -> float:
    """The compiler's bytes accessed for one bf16 `[8, 4096] @ [4096, 1792]` matmul, over the
    bytes of its operands and result: how far `cost_analysis` is from HBM traffic."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pallas_kernels.aot import topology_devices

    mesh = Mesh(topology_devices(chip)[:1], ("x",))
    placed = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16, sharding=placed)
    w = jax.ShapeDtypeStruct((4096, 1792), jnp.bfloat16, sharding=placed)
    cost = jax.jit(jnp.matmul).lower(x, w).compile().cost_analysis()
    return cost["bytes accessed"] / (2 * (8 * 4096 + 4096 * 1792 + 8 * 1792))


def attention_flops(case: aot.ServingCase, query_tokens: int, context: int,
                    chips: int) -> float:
    """FLOPs per chip of attention over `context` keys for `query_tokens` queries (QK and PV),
    which the kernel's custom call does not report."""
    config = case.model_config
    heads = config.num_heads // min(chips, config.num_heads)
    return 4.0 * query_tokens * context * config.head_dim * heads * config.num_layers


def quantized_matmul_flops(case: aot.ServingCase, num_tokens: int) -> float:
    """FLOPs per chip of the quantized projections over `num_tokens` tokens, which the
    compiler does not count either (each is a Mosaic kernel): 2 x T x their weights, split
    over the tensor-parallel axis."""
    if case.weights == "bf16":
        return 0.0
    shapes = memory_plan.linear_shapes(case.model_config, quantizable_only=True)
    return 2.0 * num_tokens * sum(k * n for k, n in shapes) / case.tensor_parallel


def run_case(case: aot.ServingCase, log) -> dict:
    """Every figure of one configuration."""
    config = case.model_config
    tp = case.tensor_parallel * case.expert_parallel
    result: dict = {"name": case.name, "chip": case.chip.name, "topology": case.topology,
                    "layers": config.num_layers}
    # 1. The largest bucket at full depth, with a modest pool: memory and compile time.
    measure = case.replace(options=dict(case.options, num_pages=4096))
    runner = aot.abstract_runner(measure)
    largest = (runner.config.max_num_batched_tokens,
               runner.config.sequences_for(runner.config.max_num_batched_tokens))
    report = aot.compile_step(runner, largest[0])
    log(f"{case.name}: largest bucket {largest} compiled in {report.compile_seconds:.0f} s")
    drafter = aot.abstract_drafter_runner(measure)
    if drafter is not None:
        # The drafter's step on the first chip, beside the target's shard, with the same
        # page count: the pool that fits is shared out between the two.
        draft = aot.compile_step(drafter, largest[0])
        fixed = (report.hbm_bytes - report.pool_bytes) + (draft.hbm_bytes - draft.pool_bytes)
        result["drafter"] = dict(
            compile_s=draft.compile_seconds, weights=draft.weight_bytes,
            inputs=draft.argument_bytes - draft.weight_bytes - draft.pool_bytes,
            temp=draft.temp_bytes, code=draft.code_bytes, page_bytes=aot.page_bytes(drafter),
            largest_pages_shared=int((available_bytes(case.chip) - fixed)
                                     // (aot.page_bytes(runner) + aot.page_bytes(drafter))))
        log(f"{case.name}: drafter step compiled in {draft.compile_seconds:.0f} s")
    pages = aot.largest_pool(report, runner, available_bytes(case.chip))
    inputs = report.argument_bytes - report.weight_bytes - report.pool_bytes
    weights_plan = memory_plan.weight_bytes(config, case.weights) / tp
    kv_plan = memory_plan.kv_bytes_per_token(config, "int8" if case.kv_cache_dtype else "bf16",
                                             case.tensor_parallel)
    result.update(
        bucket=largest, compile_s=report.compile_seconds, weights=report.weight_bytes,
        weights_plan=weights_plan, inputs=inputs, temp=report.temp_bytes,
        code=report.code_bytes, page_bytes=aot.page_bytes(runner),
        kv_token_bytes=aot.page_bytes(runner) / runner.config.page_size, kv_token_plan=kv_plan,
        largest_pages=pages, collectives_total=report.collectives,
        full_flops=report.flops, page_size=runner.config.page_size)
    # 2. The compiler checks the largest pool: it fits, and 5% more does not.
    fits = aot.compile_step(aot.abstract_runner(case.replace(options=dict(
        case.options, num_pages=pages))), largest[0])
    headroom = available_bytes(case.chip) - fits.hbm_bytes
    if headroom > 0.01 * fits.pool_bytes:
        # The program with the big pool needed less than the small one predicted (the
        # compiler's temporaries change with the pool): take the room left, once.
        pages += int(headroom // aot.page_bytes(runner))
        fits = aot.compile_step(aot.abstract_runner(case.replace(options=dict(
            case.options, num_pages=pages))), largest[0])
    result["largest_pages"] = pages
    result["largest_hbm"] = fits.hbm_bytes
    try:
        aot.compile_step(aot.abstract_runner(case.replace(options=dict(
            case.options, num_pages=int(pages * GROWTH)))), largest[0])
        result["over_refused"] = False
    except Exception as error:  # the TPU compiler's out-of-HBM error
        result["over_refused"] = "RESOURCE_EXHAUSTED" in str(error)
    log(f"{case.name}: {pages} pages fit ({fits.hbm_bytes / 2**30:.2f} GiB); "
        f"{GROWTH:.2f}x refused: {result['over_refused']}")
    # 3. Costs per bucket from 1- and 2-layer programs; collectives per layer. The bytes a
    # step must move through HBM: the weights, the step's inputs, the KV it reads, and the
    # logits written and read once ([Q, V] float32, gathered whole on every chip).
    estimates = {}
    for batch in DECODE_BATCHES:
        flops, collectives, inputs, accessed = layer_costs(case, runner.token_bucket(batch))
        kv = aot.kv_read_bytes(runner, batch, CONTEXT)
        logits = 2 * 4 * batch * config.vocab_size
        num_tokens = runner.token_bucket(batch)
        total_flops = (flops.at(config.num_layers) + quantized_matmul_flops(case, num_tokens)
                       + attention_flops(case, batch, CONTEXT, case.tensor_parallel))
        total_bytes = report.weight_bytes + inputs + kv + logits
        seconds = aot.roofline_seconds(case.chip, total_flops, total_bytes)
        estimates[f"decode_{batch}"] = dict(
            ms=1000 * seconds, tokens_per_s=batch / seconds, flops=total_flops,
            quantized_flops=quantized_matmul_flops(case, num_tokens),
            bytes=total_bytes, kv_bytes=kv, input_bytes=inputs, logits_bytes=logits,
            compiler_bytes=accessed + kv)
        if batch == DECODE_BATCHES[-1]:
            result["collectives_per_layer"] = {op: c.per_layer for op, c in collectives.items()}
            result["collectives_fixed"] = {op: c.fixed for op, c in collectives.items()}
    flops, _, inputs, accessed = layer_costs(case, PREFILL_TOKENS)
    total_flops = (flops.at(config.num_layers) + quantized_matmul_flops(case, PREFILL_TOKENS)
                   + attention_flops(case, PREFILL_TOKENS, PREFILL_TOKENS // 2,
                                     case.tensor_parallel))
    total_bytes = report.weight_bytes + inputs + aot.kv_read_bytes(runner, 1, PREFILL_TOKENS)
    seconds = aot.roofline_seconds(case.chip, total_flops, total_bytes)
    estimates["prefill"] = dict(ms=1000 * seconds, tokens_per_s=PREFILL_TOKENS / seconds,
                                flops=total_flops, bytes=total_bytes, compiler_bytes=accessed,
                                quantized_flops=quantized_matmul_flops(case, PREFILL_TOKENS))
    # The extrapolation against the full-depth program (same bucket, different pool),
    # unrolled as the 1- and 2-layer programs are.
    flops_largest, _, _, _ = layer_costs(case, largest[0])
    unrolled = aot.compile_step(aot.abstract_runner(measure, scan_layers=False), largest[0])
    result["extrapolation_ratio"] = flops_largest.at(config.num_layers) / unrolled.flops
    result["estimates"] = estimates
    return result


_AVAILABLE: dict[str, int] = {}
_ACCOUNTING: dict[str, float] = {}


def available_bytes(chip: aot.Chip) -> int:
    """The HBM the TPU compiler lets a program use on `chip`, read from its own out-of-memory
    message for a program that cannot fit (it is below the published HBM: the runtime keeps
    some)."""
    if chip.name not in _AVAILABLE:
        case = aot.ServingCase(name="probe", preset="llama-3-8b", topology=f"{chip.name}:2x2"
                               if chip.name in ("v5e", "v6e") else f"{chip.name}:2x2x1",
                               tensor_parallel=1, num_layers=1,
                               options=dict(OPTIONS, num_pages=int(2 * chip.hbm_bytes // 65536)))
        try:
            aot.compile_step(aot.abstract_runner(case), 8)
        except Exception as error:
            match = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(error))
            if match is None:
                raise
            _AVAILABLE[chip.name] = int(float(match.group(1)) * 2**30)
        else:
            raise RuntimeError(f"a program twice {chip.name}'s HBM compiled")
    return _AVAILABLE[chip.name]


def depth_times(log) -> list[tuple[int, float]]:
    """Compile seconds of the largest bucket at each depth."""
    rows = []
    for layers in DEPTHS:
        case = DEPTH_CASE.replace(num_layers=layers, options=dict(DEPTH_CASE.options,
                                                                  num_pages=4096))
        runner = aot.abstract_runner(case)
        report = aot.compile_step(runner, runner.config.max_num_batched_tokens)
        log(f"depth {layers}: {report.compile_seconds:.0f} s")
        rows.append((layers, report.compile_seconds))
    return rows


def _gib(count: float) -> str:
    return f"{count / 2**30:.2f}"


def render(results: list[dict], depths: list[tuple[int, float]], seconds: float) -> str:
    """The results section as markdown."""
    cpu = subprocess.run(["bash", "-c", "lscpu | grep 'Model name' | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip()
    lines = [
        f"Command: `make tpu-env && .venv-tpu/bin/python benchmarks/tpu_aot.py` "
        f"({datetime.date.today()}, {seconds / 60:.0f} min on a {cpu}, "
        f"{platform.python_version()}; jax {importlib.metadata.version('jax')}, "
        f"libtpu {importlib.metadata.version('libtpu')}).",
        "",
        "Every program below was compiled by the TPU compiler for the named slice on a CPU "
        "machine: the engine's own jitted step (`ModelRunner`, abstract weights) with the "
        "Pallas kernels, sharded as the engine shards it. Engine options: "
        f"`{json.dumps(OPTIONS)}`. Largest bucket: T = {PREFILL_TOKENS} tokens, Q = 256 "
        "sequences.",
        "",
        "### HBM per chip",
        "",
        "Weights and pool from the arguments' shardings; inputs are the step's other "
        "arguments (token ids, page tables, sampling arrays); temporaries and code from "
        "`memory_analysis()`. `plan` is `jaxinfer.memory_plan` for the same model, format and "
        "TP. Largest pool: the most pages (of 16 tokens) that fit beside the rest in the HBM "
        "the compiler allows; the program compiles with it, and with 5% more the compiler "
        "refuses it (out of HBM). The plan's tokens: `jaxinfer.memory_plan`'s rule (10% "
        "of the published HBM kept back for activations, programs and the runtime).",
        "",
        "| configuration | weights GiB (plan) | inputs GiB | temp GiB | code MiB | "
        "KV bytes/token (plan) | largest pool: pages / tokens (plan's tokens) | "
        "HBM used / allowed GiB | +5% refused |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        allowed = _AVAILABLE[r["chip"]]
        # memory_plan.plan's rule: 10% of the chip's HBM kept back, the rest after the
        # weights for KV.
        hbm = aot.CHIPS[r["chip"]].hbm_bytes
        planned = int((0.9 * hbm - r["weights_plan"]) // r["kv_token_plan"])
        lines.append(
            f"| {r['name']} | {_gib(r['weights'])} ({_gib(r['weights_plan'])}) | "
            f"{_gib(r['inputs'])} | {_gib(r['temp'])} | {r['code'] / 2**20:.0f} | "
            f"{r['kv_token_bytes']:,.0f} ({r['kv_token_plan']:,}) | "
            f"{r['largest_pages']:,} / {r['largest_pages'] * r['page_size']:,} "
            f"({planned:,}) | {_gib(r['largest_hbm'])} / {_gib(allowed)} | "
            f"{'yes' if r['over_refused'] else 'NO'} |")
    lines += [
        "",
        "### Estimated speed (roofline of the compiled programs: estimates, not measurements)",
        "",
        "Per step and per replica: max(FLOPs / peak bf16, bytes / HBM bandwidth), with the "
        "chip's published peaks "
        + ", ".join(f"{c.name} {c.bf16_flops / 1e12:.0f} TFLOP/s and "
                    f"{c.hbm_bandwidth / 1e9:,.0f} GB/s" for c in aot.CHIPS.values())
        + ". FLOPs: the compiler's (`cost_analysis`, extrapolated from 1 and 2 layers), plus "
        "attention's and the int8 projections' from the sizes (their Mosaic kernels report "
        "none). Bytes: what must cross "
        "HBM once per step: the weights per chip, the step's inputs, the KV read (decode: "
        f"every sequence holds {CONTEXT} tokens; prefill: one {PREFILL_TOKENS}-token prompt) "
        "and the [Q, V] float32 logits written and read. The compiler's own `bytes accessed` "
        "is not used for the bound: for one bf16 [8, 4096] x [4096, 1792] matmul it reports "
        f"{_ACCOUNTING.get('v5e', float('nan')):.1f}x the bytes of the operands and result "
        "(it counts per-fusion operand traffic, not HBM traffic); it is listed for "
        "reference. Collectives over ICI and host overheads are not counted.",
        "",
        "| configuration | decode b=1 ms (tok/s) | b=64 ms (tok/s) | b=256 ms (tok/s) | "
        "b=256 GB: weights / inputs / KV / logits (compiler's) | prefill tok/s | "
        "FLOPs check |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        e = r["estimates"]
        d256 = e["decode_256"]
        lines.append(
            f"| {r['name']} | {e['decode_1']['ms']:.2f} ({e['decode_1']['tokens_per_s']:,.0f}) "
            f"| {e['decode_64']['ms']:.2f} ({e['decode_64']['tokens_per_s']:,.0f}) | "
            f"{d256['ms']:.2f} ({d256['tokens_per_s']:,.0f}) | {r['weights'] / 1e9:.2f} / "
            f"{d256['input_bytes'] / 1e9:.2f} / {d256['kv_bytes'] / 1e9:.2f} / "
            f"{d256['logits_bytes'] / 1e9:.2f} ({d256['compiler_bytes'] / 1e9:.1f}) | "
            f"{e['prefill']['tokens_per_s']:,.0f} | {r['extrapolation_ratio']:.3f} |")
    lines += [
        "",
        "FLOPs check: the largest bucket's FLOPs extrapolated from 1 and 2 layers, over the "
        "full-depth program's own figure (1.000: the extrapolation is exact).",
        "",
        "### Collectives per layer (compiled HLO)",
        "",
        "| configuration | per layer: all-reduce / all-gather / reduce-scatter / all-to-all "
        "/ permute | once per step | whole program |",
        "|---|---|---|---|",
    ]
    for r in results:
        per = " / ".join(f"{r['collectives_per_layer'][op]:g}" for op in aot.COLLECTIVES)
        once = ", ".join(f"{r['collectives_fixed'][op]:g} {op}" for op in aot.COLLECTIVES
                         if r["collectives_fixed"][op])
        total = ", ".join(f"{count} {op}" for op, count in r["collectives_total"].items()
                          if count)
        lines.append(f"| {r['name']} | {per} | {once or '-'} | {total or '-'} |")
    drafted = [r for r in results if "drafter" in r]
    if drafted:
        lines += [
            "",
            "### Speculative decoding with a draft model",
            "",
            "The drafter (`jaxinfer.engine.spec.draft_model`) runs on the first chip of the "
            "replica, unsharded, with the target's page count; its step (largest bucket, "
            "returning each drawn token's distribution) compiled for that chip. The target's "
            "step takes the drafts and their [Q, R, V] float32 distributions as inputs. "
            "Largest shared pool: the pages for which target shard and drafter both fit on "
            "the first chip (the compiler checks each program alone, so this one is "
            "arithmetic over their compiled sizes).",
            "",
            "| configuration | target inputs GiB | drafter weights GiB | drafter inputs GiB "
            "| drafter temp GiB | drafter KV bytes/page | largest shared pool: pages / tokens "
            "| drafter compile s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in drafted:
            d = r["drafter"]
            lines.append(
                f"| {r['name']} | {_gib(r['inputs'])} | {_gib(d['weights'])} | "
                f"{_gib(d['inputs'])} | {_gib(d['temp'])} | {d['page_bytes']:,} | "
                f"{d['largest_pages_shared']:,} / "
                f"{d['largest_pages_shared'] * r['page_size']:,} | {d['compile_s']:.0f} |")
    lines += [
        "",
        "### Compile time against depth",
        "",
        f"{DEPTH_CASE.name}, largest bucket; compile times of the cases above are in "
        "the JSON beside this file.",
        "",
        "| layers | compile s |",
        "|---:|---:|",
        *[f"| {layers} | {seconds:.0f} |" for layers, seconds in depths],
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/tpu_aot.md")
    parser.add_argument("--cases", default="", help="comma-separated case indices (all)")
    parser.add_argument("--no-depth", action="store_true", help="skip the depth table")
    parser.add_argument("--depth-only", action="store_true",
                        help="only the depth table, merged into the earlier run's JSON")
    parser.add_argument("--render-only", action="store_true",
                        help="write the section from the JSON of an earlier run")
    args = parser.parse_args()
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    if args.render_only:
        previous = json.loads(Path(args.out).with_suffix(".json").read_text())
        _AVAILABLE.update(previous["available"])
        _ACCOUNTING.update(previous["matmul_accounting"])
        section = render(previous["results"], previous["depths"],
                         previous.get("seconds", 0.0))
        replace_section(Path(args.out), "serving-step", section, title=TITLE)
        print(section)
        return
    if not (args.cases or args.depth_only):
        # One process per case: libtpu 0.0.42.1 keeps state between topologies, and a long
        # run failed on a later topology's collectives ("Unexpected device_id 11") that
        # compile in a fresh process. Each run merges its case into the JSON.
        Path(args.out).with_suffix(".json").unlink(missing_ok=True)
        passes = [["--cases", str(index), "--no-depth"] for index in range(len(CASES))]
        passes += [] if args.no_depth else [["--depth-only"]]
        for extra in [*passes, ["--render-only"]]:
            subprocess.run([sys.executable, __file__, "--out", args.out, *extra], check=True)
        return
    chosen = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else list(CASES)
    if args.depth_only:
        chosen = []
    _ACCOUNTING["v5e"] = matmul_accounting("v5e")
    results: list[dict] = []
    depths: list[tuple[int, float]] = []
    prior = 0.0  # seconds of the earlier run a partial run adds to
    earlier = Path(args.out).with_suffix(".json")
    if (args.cases or args.depth_only) and earlier.exists():
        # A partial run replaces its cases in the earlier run's results and keeps the rest.
        previous = json.loads(earlier.read_text())
        names = {case.name for case in chosen}
        results = [r for r in previous["results"] if r["name"] not in names]
        depths = [tuple(row) for row in previous["depths"]]
        _AVAILABLE.update(previous["available"])
        prior = previous.get("seconds", 0.0)

    def save() -> None:  # after every case, so a late failure loses nothing
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"results": results, "depths": depths, "available": _AVAILABLE,
             "matmul_accounting": _ACCOUNTING,
             "seconds": prior + time.perf_counter() - started}, indent=1, default=str))

    for case in chosen:
        results.append(run_case(case, log))
        save()
    if not args.no_depth:
        depths = depth_times(log)
        save()
    order = [case.name for case in CASES]
    results.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    elapsed = prior + time.perf_counter() - started
    replace_section(Path(args.out), "serving-step", render(results, depths, elapsed),
                    title=TITLE)
    print(render(results, depths, elapsed))


if __name__ == "__main__":
    main()
