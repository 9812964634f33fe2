"""`jaxinfer bench latency` on the tiny preset: decode ms/token is (t(N) - t(1)) / (N - 1) of
the recorded timings on both sides, nothing compiles after warm-up, and the engine's greedy
tokens equal HF transformers' for every batch size."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from jaxinfer.bench.latency import (
    LATENCY_DEFAULTS,
    default_token_budget,
    latency_engine_options,
    latency_table,
    parse_batch_sizes,
    run_latency,
)
from jaxinfer.bench.throughput import load_bench_model
from jaxinfer.cli import main

OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def result():
    model = load_bench_model("random:tiny")
    # Token buckets 16 and 32: 2 programs; a batch of 3 prefills 24 tokens at once.
    options = dict(max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=16)
    started = time.perf_counter()
    result = run_latency(model, batch_sizes=(1, 3), input_len=8, output_len=OUTPUT_LEN,
                         iterations=2, options=options, compare_hf=True, hf_threads=1)
    result["wall_s"] = time.perf_counter() - started
    return result


def _check_side(side: dict) -> None:
    assert len(side["full_s"]) == len(side["first_s"]) == 2
    assert all(seconds > 0 for seconds in side["full_s"] + side["first_s"])
    assert side["e2e_s"] == statistics.median(side["full_s"])
    assert side["first_token_s"] == statistics.median(side["first_s"])
    assert side["decode_ms_per_token"] == pytest.approx(
        1000 * (side["e2e_s"] - side["first_token_s"]) / (OUTPUT_LEN - 1))
    # No sign check: the full and first-token runs are separate timings of a few ms each, so
    # on a noisy machine their difference can come out negative (CI saw -0.39 ms).


def test_rows_per_batch_size_and_both_sides(result):
    assert [row["batch_size"] for row in result["rows"]] == [1, 3]
    assert result["engine"]["compilations_during_run"] == 0
    assert result["engine"]["programs"] == 3  # one per token bucket (1, 16, 32)
    total = 0.0
    for row in result["rows"]:
        _check_side(row["engine"])
        _check_side(row["hf"])
        assert row["engine_over_hf"] == pytest.approx(
            row["engine"]["decode_ms_per_token"] / row["hf"]["decode_ms_per_token"])
        total += sum(row["engine"]["full_s"] + row["hf"]["full_s"])
    assert total < result["wall_s"]


def test_greedy_tokens_agree_with_hf(result):
    assert [row["hf_token_agreement"] for row in result["rows"]] == [1.0, 1.0]


def test_table_shows_every_row(result):
    table = latency_table(result)
    for row in result["rows"]:
        assert f"| {row['batch_size']} | jaxinfer engine | " \
               f"{row['engine']['decode_ms_per_token']:.2f} |" in table
        assert f"| {row['engine_over_hf']:.2f}x |" in table
    assert table.count("| HF transformers |") == 2


def test_cli_json_and_markdown(tmp_path, capsys):
    json_path, markdown = tmp_path / "latency.json", tmp_path / "report.md"
    assert main(["bench", "latency", "--model", "random:tiny", "--batch-size", "1,2",
                 "--input-len", "5", "--output-len", "4", "--iterations", "1",
                 "--max-num-batched-tokens", "16", "--min-token-bucket", "16",
                 "--output-json", str(json_path), "--markdown", str(markdown)]) == 0
    numbers = json.loads(json_path.read_text())
    assert numbers["batch_sizes"] == [1, 2] and numbers["output_len"] == 4
    assert numbers["engine_settings"]["max_num_seqs"] == 2  # the largest batch
    assert numbers["engine"]["compilations_during_run"] == 0
    assert all("hf" not in row and row["engine"]["e2e_s"] > 0 for row in numbers["rows"])
    assert "| 2 | jaxinfer engine |" in capsys.readouterr().out
    text = markdown.read_text()
    assert text.startswith("## jaxinfer bench latency (")
    assert "--batch-size 1,2" in text and "| 1 | jaxinfer engine |" in text


def test_argument_checks(capsys):
    assert parse_batch_sizes("1,16") == (1, 16)
    assert parse_batch_sizes("4") == (4,)
    for bad in ("", "0", "a", "1,-2"):
        with pytest.raises(ValueError, match="batch sizes"):
            parse_batch_sizes(bad)
    assert default_token_budget((1, 16), 32) == 32
    assert default_token_budget((1,), 33) == 64
    assert default_token_budget((1, 64), 32) == 64
    assert main(["bench", "latency", "--model", "random:tiny", "--output-len", "1"]) == 2
    assert "need >= 2" in capsys.readouterr().err


def test_engine_sizes_left_unset_follow_the_batches():
    sized = latency_engine_options(None, (1, 3), 40)
    assert sized == {**LATENCY_DEFAULTS, "max_num_seqs": 3, "max_num_batched_tokens": 64}
    given = latency_engine_options({"max_num_seqs": 128, "page_size": 8}, (1, 3), 40)
    assert (given["max_num_seqs"], given["max_num_batched_tokens"], given["page_size"]) == (
        128, 128, 8)  # the budget holds a decode of every running request
    assert latency_engine_options({"max_num_batched_tokens": 16}, (2,), 40)[
        "max_num_batched_tokens"] == 16
