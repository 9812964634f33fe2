"""The kernel compile matrix: every case of `pallas_kernels/aot_cases.py` compiled for TPU v4,
v5e, v5p and v6e on this machine (no TPU needed), with compile time, VMEM and HBM per case.

    .venv-tpu/bin/python benchmarks/tpu_kernels.py [--chips v5e,v6e] \
        [--out benchmarks/results/tpu_kernels.md]

Runs in the `jax[tpu]` environment (`make tpu-env`); `make tpu-check` compiles the same
cases as tests. The result is a markdown file: the command, date, jax and libtpu
versions, the machine, each chip's VMEM and default scoped limit, and one table row per
(case, chip). Exits non-zero if any case failed to compile or did not fit VMEM.

VMEM per kernel is the compiler's scoped allocation (`used_scoped_memory_configs` of the
compiled Mosaic call: pipeline buffers and internal scratch) plus the kernel's VMEM scratch
operands, which that figure leaves out, computed from their shapes padded to Mosaic's tiling
(see `pallas_kernels/aot.py`). HBM bytes are the compiled program's `memory_analysis()`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

import jax

from pallas_kernels import aot, aot_cases


def _machine() -> str:
    """`lscpu`'s model name and the CPU count."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lines.splitlines()
                     if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} CPUs"


_TABLE_HEADER = (
    "| kernel | case | chip | fits | compile s | VMEM MiB: scoped + scratch = total / chip "
    "| scoped limit MiB | HBM args MiB | HBM out MiB | HBM temp MiB |\n"
    "|---|---|---|---|---:|---|---:|---:|---:|---:|\n")


def _mib(count: int | None) -> str:
    return "-" if count is None else f"{count / 2**20:.2f}"


def _row(case: aot_cases.Case, chip: str, result: aot.AotResult, fits: bool) -> str:
    if not result.ok:
        return (f"| {case.kernel} | {case.name} | {chip} | **no** | {result.seconds:.1f} "
                f"| - | - | - | - | - |")
    vmem = (f"{_mib(result.scoped_vmem_bytes)} + {_mib(result.scratch_vmem_bytes)} = "
            f"{_mib(result.vmem_bytes)} / {aot.vmem_capacity(chip) // 2**20}")
    return (f"| {case.kernel} | {case.name} | {chip} | {'yes' if fits else '**over**'} "
            f"| {result.seconds:.1f} | {vmem} | {aot.DEFAULT_SCOPED_VMEM[chip] // 2**20} "
            f"| {_mib(result.argument_bytes)} | {_mib(result.output_bytes)} "
            f"| {_mib(result.temp_bytes)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default=",".join(aot.TOPOLOGIES),
                        help="comma-separated chips (default: all of aot.TOPOLOGIES)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tpu_kernels.md"))
    args = parser.parse_args()
    if not aot.tpu_compiler_available():
        print("no TPU compiler (libtpu) here: run in .venv-tpu (make tpu-env)", file=sys.stderr)
        return 2
    chips = args.chips.split(",")
    cases = aot_cases.MATRIX

    rows, failures, start = [], [], time.perf_counter()
    for case in cases:
        for chip in chips:
            result = case.compile(chip)
            fits = result.ok and result.vmem_bytes is not None and (
                result.scoped_vmem_bytes <= aot.DEFAULT_SCOPED_VMEM[chip]
                and result.vmem_bytes <= aot.vmem_capacity(chip))
            rows.append(_row(case, chip, result, fits))
            if not fits:
                failures.append(f"- {case.kernel} {case.name} on {chip}: "
                                f"{result.error or 'VMEM over the limit, or no Mosaic kernel'}")
            print(rows[-1], flush=True)
    total = time.perf_counter() - start

    command = "python benchmarks/tpu_kernels.py" + (
        f" --chips {args.chips}" if args.chips != ",".join(aot.TOPOLOGIES) else "")
    chip_lines = "\n".join(
        f"| {chip} | {aot.TOPOLOGIES[chip]} | {aot.topology_devices(chip)[0].device_kind} "
        f"| {aot.vmem_capacity(chip) // 2**20} | {aot.DEFAULT_SCOPED_VMEM[chip] // 2**20} |"
        for chip in chips)
    text = f"""# TPU kernel compile matrix

Every Pallas kernel case of `pallas_kernels/aot_cases.py` compiled ahead of time for each TPU
chip through Mosaic, on a machine without a TPU (issue 19). The case tables and the covering
design of the attention cases are documented in `pallas_kernels/aot_cases.py`; `make
tpu-check` (CI) compiles the same cases and asserts the same VMEM limits.

Command: `{command}` (in `.venv-tpu`)
Date: {datetime.date.today().isoformat()}
Versions: jax {jax.__version__}, jaxlib {importlib.metadata.version("jaxlib")}, libtpu \
{importlib.metadata.version("libtpu")}
Machine: {_machine()}
Result: {len(rows)} compiles ({len(cases)} cases x {len(chips)} chips), {len(failures)} \
failures, {total:.0f} s in all.

Chips. VMEM is one TensorCore's, from jax's hardware table (`pltpu.get_tpu_info_for_chip`,
`jax/_src/pallas/mosaic/tpu_info.py` in jax {jax.__version__}), the figure the compiler
itself rejects an oversized kernel with ("would exceed memory (size=N)"; checked by
`test_vmem_capacity_is_the_compilers`). The default scoped limit is what the compiler allows a
kernel's own allocation without `vmem_limit_bytes` (none of these kernels sets it), as libtpu
states it in its errors: "limit 16.00M" on v5e and v5p, "limit 32.00M" on v6e; on v4 the
whole 16 MiB ("Used ... of 16.00M vmem"; `test_default_scoped_vmem_is_the_compilers`).

| chip | topology | device kind | VMEM MiB | default scoped limit MiB |
|---|---|---|---:|---:|
{chip_lines}

Columns. VMEM (MiB): the compiler's scoped allocation of the kernel (BlockSpec pipeline
buffers and Mosaic's internal scratch, read from the compiled program) + the kernel's VMEM
scratch operands (computed from their shapes, padded to Mosaic's memref tiling) = the
kernel's total / the chip's VMEM. "fits" means the scoped part is within the default scoped
limit and the total within the chip's VMEM. HBM (MiB, per chip): the compiled program's
argument, output and temporary bytes (`memory_analysis()`). Compile seconds include tracing
and lowering, on this shared 2-core machine.

""" + _TABLE_HEADER + "\n".join(rows) + "\n"
    if failures:
        text += "\n## Failures\n\n" + "\n".join(failures) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"{len(rows)} compiles, {len(failures)} failures, {total:.0f} s; wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
