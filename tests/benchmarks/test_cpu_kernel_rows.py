"""The kernel-rows report: each row's speed-up is that of the walk `cpu.py` routes it to."""

from __future__ import annotations

from benchmarks.cpu_kernel_rows import dense_markdown, markdown
from pallas_kernels.quant_matmul import cpu


def _row(rows):
    return {"shape": "576 x 1536", "format": "int8", "rows": rows, "xla float32": 1.2,
            "walk": 0.6, "panel": 0.4, "int8 act": 0.3}


def test_the_speed_up_column_follows_the_default_walk():
    peaks = {"f32_gflops": 150.0, "read_gb_s": 24.0}
    lines = markdown([_row(1), _row(cpu.PANEL_ROWS)], peaks, "python x.py").splitlines()
    # int8 activations up to DECODE_ROWS rows (1.2 / 0.3), the panel from PANEL_ROWS (1.2 / 0.4).
    assert "| 576 x 1536 | int8 | 1 | 1.200 | 0.600 | 0.400 | 0.300 | 4.00x |" in lines
    assert (f"| 576 x 1536 | int8 | {cpu.PANEL_ROWS} | 1.200 | 0.600 | 0.400 | 0.300 | "
            "3.00x |") in lines


def test_dense_rows_say_whether_the_kernel_is_routed():
    text = dense_markdown([{"shape": "576 x 1536", "dtype": "bfloat16", "rows": 64,
                            "xla": 2.0, "kernel": 1.0, "routed": True},
                           {"shape": "49152 x 576 (tied head)", "dtype": "float32",
                            "rows": 64, "xla": 30.0, "kernel": 31.0, "routed": False}])
    lines = text.splitlines()
    assert "| 576 x 1536 | bfloat16 | 64 | 2.000 | 1.000 | 2.00x | yes |" in lines
    assert "| 49152 x 576 (tied head) | float32 | 64 | 30.000 | 31.000 | 0.97x | no |" in lines
