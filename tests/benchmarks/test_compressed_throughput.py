"""The 64-request report's table: each format's rate over float32's, failures kept as rows."""

from __future__ import annotations

from benchmarks.compressed_throughput import markdown


def _report(rows):
    return {"date": "2026-12-07 16:00 UTC", "command": "python benchmarks/x.py",
            "commit": "abc1234", "cpu": "AMD EPYC", "load": "machine quiet",
            "peaks": {"f32_gflops": 150.0, "bf16_gflops": 140.0, "read_gb_s": 24.0},
            "rows": rows}


def _row(name, output_rate):
    return {"name": name, "output_tokens_per_s": output_rate,
            "total_tokens_per_s": output_rate * 3, "elapsed_s": 8192 / output_rate}


def test_each_format_is_set_against_float32_and_a_failure_stays_a_row():
    text = markdown(_report([_row("float32", 160.0), _row("GGUF", 240.0),
                             {"name": "bfloat16", "error": "out of memory"}]))
    lines = text.splitlines()
    assert "| float32 | 160.0 | 480.0 | 51.2 | 1.00x |" in lines
    assert "| GGUF | 240.0 | 720.0 | 34.1 | 1.50x |" in lines
    assert "| bfloat16 | failed: out of memory | | | |" in lines


def test_without_a_float32_figure_no_ratio_is_made_up():
    text = markdown(_report([{"name": "float32", "error": "exit 1"}, _row("GGUF", 240.0)]))
    assert "| GGUF | 240.0 | 720.0 | 34.1 | - |" in text.splitlines()
