"""The KV-dtype decode timing: every dtype's engine timed in turns, and its table."""

from __future__ import annotations

import pytest

from benchmarks.kv_dtypes import decode_tokens_per_second, markdown
from jaxinfer.bench.throughput import load_bench_model, machine_info


@pytest.fixture(scope="module")
def decode():
    return decode_tokens_per_second(load_bench_model("random:tiny"),
                                    ["float32", "fp8_e4m3", "int4"], batch_size=3,
                                    input_len=8, rounds=3, steps=2)


def test_each_dtype_gets_one_turn_a_round_and_its_fastest_turn_is_the_figure(decode):
    assert list(decode) == ["float32", "fp8_e4m3", "int4"]
    for row in decode.values():
        assert len(row["ms_per_step"]) == 3 and min(row["ms_per_step"]) > 0
        assert row["tokens_per_s"] == pytest.approx(3 * 1000.0 / min(row["ms_per_step"]))
        assert row["median_tokens_per_s"] <= row["tokens_per_s"]


def test_the_table_sets_each_dtype_against_float32(decode):
    text = markdown({"rows": [], "streamed": [], "decode": decode, "decode_batch": 3,
                     "contexts": (512,), "pool_mib": 256, "stream": [1, 64, 32],
                     "machine": machine_info()}, "python benchmarks/kv_dtypes.py --decode")
    float32_line = [line for line in text.splitlines() if line.startswith("| float32 |")]
    assert float32_line and "| 1.00 |" in float32_line[0]
    assert any(line.startswith("| int4 |") for line in text.splitlines())
