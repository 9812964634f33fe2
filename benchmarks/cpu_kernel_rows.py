"""The CPU matmul kernels' walks at decode row counts, against XLA's float32 dot.

    python benchmarks/cpu_kernel_rows.py [--out benchmarks/results/kernels.md] [--repeats N]

SmolLM2-135M's layer shapes (576 -> 1536, 1536 -> 576, 576 -> 192) read from a stack of 30
layers as the engine's scan does, int8 per channel and int4 g32 with zero points, at 1 to 64
rows, in each of `pallas_kernels.quant_matmul.cpu`'s walks:

- "walk": float activations, the register walk (the weight decoded again per pair of rows);
- "panel": float activations, a dequantized 16-column panel under a 6 x 16 register tile;
- "int8 act": int8 activations, integer products;
- and XLA's float32 dot of the float32 layer (what the float32 model runs).

and the dense kernel (`pallas_kernels.dense_matmul.cpu`, float32 and bfloat16 weights, its
[K, N] layers and the tied [N, K] LM head) against XLA's dot at 16 to 128 rows.

The defaults that the two `cpu.py` files state (`DECODE_ROWS`, `PANEL_ROWS`, `AVX2_MAX_ROWS`)
are read from these tables. Their section of `--out` is replaced, the rest of the file kept.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.compressed_decode import cpu_name, machine_peaks  # noqa: E402
from benchmarks.results_file import replace_section  # noqa: E402
from pallas_kernels.dense_matmul import cpu as dense_cpu  # noqa: E402
from pallas_kernels.quant_matmul import cpu, quantize_weight  # noqa: E402

LAYERS = 30
SHAPES = [(576, 1536), (1536, 576), (576, 192)]  # (K, N) of gate/up, down, k/v
ROWS = (1, 2, 4, 6, 8, 16, 32, 64)
FORMATS = {"int8": dict(), "int4 g32 zeros": dict(group_size=32, symmetric=False)}
FORMAT_NAMES = {"int8": "int8", "int4 g32 zeros": "int4"}


def _best_ms(function, *args, repeats: int) -> float:
    """The best of `repeats` timings of 20 calls each, in ms per call."""
    jax.block_until_ready(function(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(20):
            out = function(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / 20)
    return best * 1e3


def _stacked(matrix_stack: np.ndarray, label: str):
    """Each layer quantized, stacked as the engine keeps them: values, scales, zeros."""
    layers = [quantize_weight(jnp.asarray(layer), FORMAT_NAMES[label], **FORMATS[label])
              for layer in matrix_stack]
    values = jnp.stack([layer.values for layer in layers])  # [L, I', O]
    scales = jnp.stack([layer.scales for layer in layers])  # [L, ...]
    zeros = None if layers[0].zeros is None else jnp.stack([layer.zeros for layer in layers])
    return values, scales, zeros, layers[0].group_size


def _kernel(label: str, mode: str):
    """The jitted kernel call in `mode`, its walk fixed while tracing."""
    weight_format = FORMAT_NAMES[label]

    def call(x, values, scales, zeros, group_size):
        return cpu.matmul(x, weight_format, values, scales, zeros, group_size, layer=3,
                          int8_activations=mode == "int8 act")

    def traced(x, values, scales, zeros, group_size):
        saved = cpu.PANEL_ROWS
        cpu.PANEL_ROWS = 1 if mode == "panel" else 1 << 30
        try:
            return jax.jit(call, static_argnums=4).lower(
                x, values, scales, zeros, group_size).compile()
        finally:
            cpu.PANEL_ROWS = saved
    return traced


def measure(repeats: int) -> list[dict]:
    """One row per (shape, format, rows): ms of each walk and of XLA's float32 dot."""
    rng = np.random.default_rng(0)
    results = []
    for depth, columns in SHAPES:
        floats = (rng.standard_normal((LAYERS, depth, columns)) * 0.02).astype(np.float32)
        dense = jnp.asarray(floats)  # [L, K, N]
        dot = jax.jit(lambda x, w: x @ w[3])
        for label in FORMATS:
            values, scales, zeros, group_size = _stacked(floats, label)
            for rows in ROWS:
                x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.float32)  # [M, K]
                row = {"shape": f"{depth} x {columns}", "format": label, "rows": rows,
                       "xla float32": _best_ms(dot, x, dense, repeats=repeats)}
                for mode in ("walk", "panel", "int8 act"):
                    compiled = _kernel(label, mode)(x, values, scales, zeros, group_size)
                    row[mode] = _best_ms(compiled, x, values, scales, zeros,
                                         repeats=repeats)
                results.append(row)
                print(row, flush=True)
    return results


DENSE_SHAPES = [(576, 1536, False), (1536, 576, False), (576, 49152, True)]
DENSE_ROWS = (16, 17, 32, 64, 128)


def measure_dense(repeats: int) -> list[dict]:
    """The dense kernel (called directly, whatever its routing says) against XLA's dot of
    the same weight widened to float32, per (shape, dtype, rows)."""
    rng = np.random.default_rng(1)
    results = []
    for depth, columns, transposed in DENSE_SHAPES:
        layers = 1 if transposed else LAYERS
        shape = (layers, columns, depth) if transposed else (layers, depth, columns)
        floats = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        layer = 0 if transposed else 3
        for dtype in (jnp.float32, jnp.bfloat16):
            weights = jnp.asarray(floats, dtype)

            def xla(x, w, layer=layer, transposed=transposed):
                matrix = w[layer].astype(jnp.float32)
                return x @ (matrix.T if transposed else matrix)

            def kernel(x, w, layer=layer, transposed=transposed):
                return dense_cpu.matmul(x, w, layer=layer, transposed=transposed)
            for rows in DENSE_ROWS:
                x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.float32)  # [M, K]
                row = {"shape": f"{columns} x {depth} (tied head)" if transposed
                       else f"{depth} x {columns}", "dtype": jnp.dtype(dtype).name,
                       "rows": rows,
                       "xla": _best_ms(jax.jit(xla), x, weights, repeats=repeats),
                       "kernel": _best_ms(jax.jit(kernel), x, weights, repeats=repeats),
                       "routed": rows <= dense_cpu.max_rows(dtype, transposed=transposed)}
                results.append(row)
                print(row, flush=True)
    return results


def dense_markdown(results: list[dict]) -> str:
    lines = ["### The dense kernel past its streaming walk (float32 panels)", "",
             "Rows above 16 take float32 panels of the weight under the same 6 x 16 tile "
             "(`cpu_panel.h`; bfloat16 widened, a tied head transposed while packed). ms per "
             "call; \"routed\": whether `dense_matmul` sends this product to the kernel.", "",
             "| weight (K x N, or N x K) | dtype | rows | XLA dot | kernel | XLA / kernel | "
             "routed |", "|---|---|---:|---:|---:|---:|---|"]
    for row in results:
        lines.append(f"| {row['shape']} | {row['dtype']} | {row['rows']} | {row['xla']:.3f} | "
                     f"{row['kernel']:.3f} | {row['xla'] / row['kernel']:.2f}x | "
                     f"{'yes' if row['routed'] else 'no'} |")
    return "\n".join(lines) + "\n"


def markdown(results: list[dict], peaks: dict, command: str) -> str:
    lines = ["## CPU matmul kernels: walks by row count (SmolLM2-135M layer shapes)", "",
             f"Command: `{command}`. Machine: {cpu_name()}, "
             f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; peaks measured "
             f"before: {peaks['f32_gflops']:.0f} GFLOP/s float32 matmul, "
             f"{peaks['read_gb_s']:.1f} GB/s read. Layer 3 of a 30-layer stack; ms per call, "
             "best of the repeats. `cpu.py` runs int8 activations up to "
             f"{cpu.DECODE_ROWS} rows and the panel from {cpu.PANEL_ROWS}.", "",
             "| shape (K x N) | format | rows | XLA float32 dot | walk | panel | int8 act | "
             "speed-up of the default over float32 |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        chosen = (row["int8 act"] if row["rows"] <= cpu.DECODE_ROWS
                  else row["panel"] if row["rows"] >= cpu.PANEL_ROWS else row["walk"])
        lines.append(f"| {row['shape']} | {row['format']} | {row['rows']} | "
                     f"{row['xla float32']:.3f} | {row['walk']:.3f} | {row['panel']:.3f} | "
                     f"{row['int8 act']:.3f} | {row['xla float32'] / chosen:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="markdown file whose section is replaced")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    peaks = machine_peaks()
    results = measure(args.repeats)
    dense = measure_dense(args.repeats)
    command = "python benchmarks/cpu_kernel_rows.py" + (f" --out {args.out}" if args.out
                                                      else "")
    text = markdown(results, peaks, command) + "\n" + dense_markdown(dense)
    print(text)
    if args.out:
        replace_section(args.out, "cpu-quant-rows", text)


if __name__ == "__main__":
    main()
