"""Kernel benchmark: each public op of `pallas_kernels` against its XLA reference.

    python benchmarks/kernels.py [--quick] [--out benchmarks/results/kernels.md]

Times every implementation the current backend can run (the Pallas kernel on TPU; the XLA
path and the readable reference everywhere) over realistic shapes, counts the bytes each op
must move and the FLOPs it must do, and reports the achieved fraction of this machine's
*measured* memory bandwidth (a large reduction) and matmul rate (a large square matmul), so a
number reads as "how close to the roofline" rather than as an absolute time.

Ops and shapes:
- ragged paged attention: decode batches of 8 to 256 sequences, a prefill step and a mixed
  step; head dims 64/128, page sizes 16/32/64, GQA groups 1/4/8, float and int8 KV;
- quantized matmul: int8, int4 (groups of 128) and W8A8 weights of a 4096 x 4096 layer at
  1, 16 and 256 tokens, beside the float matmul of the same layer;
- MoE: the grouped matmul (8 experts, top-2) over 64 and 1024 tokens, float and int8;
- dense matmul (float weights, the engine's linear layers): bench-30m's MLP projections
  (512 x 1536 and 1536 x 512) over a scan of 32 stacked layers, as the engine's step runs
  them, at 1 to 1024 rows: the CPU kernel (`dense_matmul`, reading each layer in place)
  against XLA's dot of the sliced layer (`dense_matmul_reference`).

`--quick` keeps the cases a 2-core CPU finishes in a few minutes. The reference attention
gathers every token's whole page table, so it is skipped where that gather would not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.dense_matmul import cpu as dense_matmul_cpu
from pallas_kernels.dense_matmul import dense_matmul, dense_matmul_reference
from pallas_kernels.moe import grouped_matmul
from pallas_kernels.quant_matmul import quantize_weight, quantized_matmul
from pallas_kernels.ragged_paged_attention import quantize_kv_rows, ragged_paged_attention

_REFERENCE_GATHER_LIMIT = 1 << 30  # bytes of the reference's [T, S, 2K, H] gather


@dataclasses.dataclass
class Row:
    """One timed (op, case, implementation)."""

    op: str
    case: str
    implementation: str
    milliseconds: float
    bytes_moved: float
    flops: float


def _time(function: Callable[[], jax.Array], repeats: int) -> float:
    """Median wall milliseconds of `function()` after one compiling call."""
    jax.block_until_ready(function())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure_machine(quick: bool) -> tuple[float, float]:
    """`(GB/s, GFLOP/s)`: a large f32 reduction's read rate and a square f32 matmul's rate."""
    elements = (64 if quick else 256) << 20
    data = jnp.ones((elements,), jnp.float32)  # [elements]
    reduce = jax.jit(jnp.sum)
    bandwidth = 4 * elements / (_time(lambda: reduce(data), 5) * 1e-3) / 1e9
    size = 2048 if quick else 4096
    a = jnp.ones((size, size), jnp.float32)  # [size, size]
    matmul = jax.jit(lambda x, y: x @ y)
    rate = 2 * size ** 3 / (_time(lambda: matmul(a, a), 3) * 1e-3) / 1e9
    return bandwidth, rate


def _implementations(reference: bool) -> list[str]:
    names = ["pallas"] if jax.default_backend() == "tpu" else []
    return [*names, "xla", *(["reference"] if reference else [])]


def _attention_case(seqs: int, query_len: int, context: int, head_dim: int, page_size: int,
                    group: int, int8_kv: bool, kv_dtype, rng: np.random.Generator):
    """Inputs of one ragged step (random pages) and its bytes and FLOPs."""
    num_kv_heads = 8
    num_heads = num_kv_heads * group
    kv_len = context + query_len
    pages_per_seq = -(-kv_len // page_size)
    num_pages = 1 + seqs * pages_per_seq
    pool_shape = (num_pages, page_size, 2 * num_kv_heads, head_dim)
    kv_pages = jnp.asarray(rng.standard_normal(pool_shape, np.float32), kv_dtype)
    kv_scales = None
    if int8_kv:
        kv_pages, kv_scales = quantize_kv_rows(kv_pages)
    tables = 1 + rng.permutation(seqs * pages_per_seq).reshape(seqs, pages_per_seq)
    tokens = seqs * query_len
    queries = jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim), np.float32),
                          kv_dtype)  # [T, N, H]
    inputs = (queries, kv_pages, jnp.full((seqs,), kv_len, jnp.int32),
              jnp.asarray(tables, jnp.int32),
              jnp.arange(seqs + 1, dtype=jnp.int32) * query_len,
              jnp.asarray([seqs], jnp.int32))
    element = jnp.dtype(kv_pages.dtype).itemsize
    kv_bytes = seqs * kv_len * 2 * num_kv_heads * head_dim * element
    scale_bytes = 0 if kv_scales is None else seqs * kv_len * 2 * num_kv_heads * 4
    io_bytes = 2 * tokens * num_heads * head_dim * jnp.dtype(kv_dtype).itemsize
    # Keys each query sees: its context plus its causal share of the step's tokens.
    visible = seqs * (query_len * context + query_len * (query_len + 1) / 2)
    flops = 4 * visible * num_heads * head_dim
    gather = tokens * pages_per_seq * page_size * 2 * num_kv_heads * head_dim * 4
    return inputs, kv_scales, kv_bytes + scale_bytes + io_bytes, flops, gather


def attention_rows(quick: bool, kv_dtype, repeats: int) -> list[Row]:
    """Decode, prefill and mixed steps of ragged paged attention."""
    rng = np.random.default_rng(0)
    # (seqs, query_len, context, head_dim, page_size, group, int8_kv)
    cases = [(8, 1, 512, 128, 16, 4, False), (64, 1, 512, 128, 16, 4, False),
             (64, 1, 512, 64, 32, 1, False), (64, 1, 512, 128, 64, 8, False),
             (64, 1, 512, 128, 16, 4, True), (4, 256, 0, 128, 16, 4, False)]
    if not quick:
        cases += [(256, 1, 1024, 128, 16, 4, False), (256, 1, 1024, 128, 16, 4, True),
                  (256, 1, 1024, 64, 32, 8, False), (8, 256, 768, 128, 32, 4, False)]
    rows = []
    for seqs, query_len, context, head_dim, page_size, group, int8_kv in cases:
        inputs, kv_scales, moved, flops, gather = _attention_case(
            seqs, query_len, context, head_dim, page_size, group, int8_kv, kv_dtype, rng)
        kind = "decode" if query_len == 1 else ("prefill" if context == 0 else "chunk")
        name = (f"{kind} S={seqs} q={query_len} ctx={context} H={head_dim} ps={page_size} "
                f"G={group}{' int8 KV' if int8_kv else ''}")
        for implementation in _implementations(gather < _REFERENCE_GATHER_LIMIT):
            step = jax.jit(lambda *arrays, implementation=implementation, scales=kv_scales,
                           sm_scale=head_dim ** -0.5:
                           ragged_paged_attention(*arrays, sm_scale=sm_scale,
                                                  kv_scales=scales,
                                                  implementation=implementation))
            milliseconds = _time(lambda step=step, inputs=inputs: step(*inputs), repeats)
            rows.append(Row("ragged_paged_attention", name, implementation, milliseconds,
                            moved, flops))
    return rows


def quant_matmul_rows(quick: bool, dtype, repeats: int) -> list[Row]:
    """A 4096 x 4096 layer in each weight format at several token counts."""
    rng = np.random.default_rng(1)
    features = 2048 if quick else 4096
    weight = jnp.asarray(rng.standard_normal((features, features), np.float32) * 0.02)
    formats = {"int8": quantize_weight(weight, "int8"),
               "int4 g128": quantize_weight(weight, "int4", group_size=128),
               "w8a8": quantize_weight(weight, "w8a8")}
    float_weight = weight.astype(dtype)
    dense = jax.jit(lambda a, w: a @ w)
    rows = []
    for tokens in (1, 16, 256):
        x = jnp.asarray(rng.standard_normal((tokens, features), np.float32), dtype)  # [T, I]
        flops = 2 * tokens * features * features
        io_bytes = 2 * tokens * features * jnp.dtype(dtype).itemsize
        rows.append(Row("matmul (float weights)", f"M={tokens} K=N={features}", "xla",
                        _time(lambda x=x: dense(x, float_weight), repeats),
                        float_weight.nbytes + io_bytes, flops))
        for label, quantized in formats.items():
            weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(quantized))
            for implementation in _implementations(reference=False):
                function = jax.jit(lambda a, w, implementation=implementation:
                                   quantized_matmul(a, w, implementation=implementation))
                rows.append(Row(f"quantized_matmul {label}", f"M={tokens} K=N={features}",
                                implementation,
                                _time(lambda x=x, q=quantized, f=function: f(x, q), repeats),
                                weight_bytes + io_bytes, flops))
    return rows


def moe_rows(quick: bool, dtype, repeats: int) -> list[Row]:
    """The grouped matmul of an 8-expert, top-2 layer (one projection, D -> F)."""
    rng = np.random.default_rng(2)
    experts, width, hidden = 8, (512 if quick else 1024), (1792 if quick else 3584)
    rhs = jnp.asarray(rng.standard_normal((experts, width, hidden), np.float32) * 0.02)
    int8_rhs = jnp.clip(jnp.round(rhs / 0.001), -127, 127).astype(jnp.int8)  # [E, D, F]
    scales = jnp.full((experts, hidden), 0.001, jnp.float32)  # [E, F]
    rows = []
    for tokens in (64, 1024):
        assignments = 2 * tokens
        sizes = np.bincount(rng.integers(0, experts, assignments), minlength=experts)
        group_sizes = jnp.asarray(sizes, jnp.int32)  # [E]
        lhs = jnp.asarray(rng.standard_normal((assignments, width), np.float32), dtype)
        flops = 2 * assignments * width * hidden
        io_bytes = assignments * (width + hidden) * jnp.dtype(dtype).itemsize
        for label, weights, weight_scales in (("float", rhs.astype(dtype), None),
                                              ("int8", int8_rhs, scales)):
            weight_bytes = weights.nbytes + (0 if weight_scales is None else scales.nbytes)
            for implementation in _implementations(reference=False):
                function = jax.jit(lambda a, w, g, s, implementation=implementation:
                                   grouped_matmul(a, w, g, scales=s,
                                                  implementation=implementation))
                milliseconds = _time(lambda f=function, a=lhs, w=weights, g=group_sizes,
                                     s=weight_scales: f(a, w, g, s), repeats)
                rows.append(Row(f"moe grouped_matmul {label}",
                                f"M={tokens} top-2 E={experts} D={width} F={hidden}",
                                implementation, milliseconds, weight_bytes + io_bytes, flops))
    return rows


def _scan_layers(matmul: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
                 stack: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """A jitted `x -> sum over layers of matmul(x, stack, layer)`, one scan iteration each."""

    def run(x: jax.Array) -> jax.Array:
        def body(total: jax.Array, layer: jax.Array) -> tuple[jax.Array, None]:
            return total + matmul(x, stack, layer), None

        start = jnp.zeros((x.shape[0], stack.shape[2]), x.dtype)  # [M, N]
        return jax.lax.scan(body, start, jnp.arange(stack.shape[0]))[0]  # [M, N]

    return jax.jit(run)


def dense_matmul_rows(quick: bool, dtype, repeats: int) -> list[Row]:
    """The engine's float projections over a scan of stacked layers, kernel against XLA."""
    rng = np.random.default_rng(3)
    layers = 8 if quick else 32
    rows = []
    for depth, width in ((512, 1536), (1536, 512)):
        stack = jnp.asarray(rng.standard_normal((layers, depth, width), np.float32) * 0.02,
                            dtype)  # [L, K, N]
        kernel = _scan_layers(lambda x, w, layer: dense_matmul(x, w, layer=layer), stack)
        xla = _scan_layers(lambda x, w, layer: dense_matmul_reference(
            x, jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)), stack)
        for tokens in (1, 8, 16, 64, 256, 1024):
            x = jnp.asarray(rng.standard_normal((tokens, depth), np.float32), dtype)  # [M, K]
            case = f"M={tokens} K={depth} N={width} x {layers} layers"
            flops = 2 * tokens * depth * width * layers
            moved = stack.nbytes + layers * tokens * (depth + width) * jnp.dtype(dtype).itemsize
            rows.append(Row("dense_matmul", case, "reference",
                            _time(lambda x=x, f=xla: f(x), repeats), moved, flops))
            if jax.default_backend() == "cpu" and dense_matmul_cpu.available():
                rows.append(Row("dense_matmul", case, "cpu kernel",
                                _time(lambda x=x, f=kernel: f(x), repeats), moved, flops))
    return rows


def markdown(rows: list[Row], bandwidth: float, rate: float, command: str) -> str:
    """The report: machine, roofline, and one table row per timed implementation."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    devices = ", ".join(sorted({device.device_kind for device in jax.devices()}))
    lines = [f"## benchmarks/kernels.py ({now})", "", "```", command, "```", "",
             f"- machine: {platform.platform()}, backend {jax.default_backend()} ({devices}), "
             f"jax {jax.__version__}",
             f"- measured roofline: {bandwidth:.1f} GB/s (f32 reduction), "
             f"{rate:.1f} GFLOP/s (f32 square matmul)", "",
             "| op | case | implementation | ms | GB/s | % of BW | GFLOP/s | % of matmul | "
             "x vs reference |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    baselines = {(row.op, row.case): row.milliseconds for row in rows
                 if row.implementation == "reference"}
    for row in rows:
        seconds = row.milliseconds * 1e-3
        achieved_bandwidth = row.bytes_moved / seconds / 1e9
        achieved_rate = row.flops / seconds / 1e9
        baseline = baselines.get((row.op, row.case))
        speedup = f"{baseline / row.milliseconds:.2f}x" if baseline else ""
        lines.append(f"| {row.op} | {row.case} | {row.implementation} | "
                     f"{row.milliseconds:.2f} | {achieved_bandwidth:.1f} | "
                     f"{100 * achieved_bandwidth / bandwidth:.0f}% | {achieved_rate:.1f} | "
                     f"{100 * achieved_rate / rate:.0f}% | {speedup} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark; prints the table and appends it to `--out` if given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small CPU-sized set")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="markdown file to append the report to")
    arguments = parser.parse_args(argv)
    # Accelerators serve in bfloat16; the CPU engine runs float32.
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    bandwidth, rate = measure_machine(arguments.quick)
    rows = [*attention_rows(arguments.quick, dtype, arguments.repeats),
            *quant_matmul_rows(arguments.quick, dtype, arguments.repeats),
            *moe_rows(arguments.quick, dtype, arguments.repeats),
            *dense_matmul_rows(arguments.quick, dtype, arguments.repeats)]
    command = "python benchmarks/kernels.py" + (" --quick" if arguments.quick else "") + (
        f" --repeats {arguments.repeats}" if arguments.repeats != 5 else "")
    report = markdown(rows, bandwidth, rate, command)
    print(report)
    if arguments.out:
        with open(arguments.out, "a", encoding="utf-8") as handle:
            handle.write("\n" + report)


if __name__ == "__main__":
    main()
