"""Rounds of the compressed-decode benchmark merge into one row per configuration."""

from __future__ import annotations

from benchmarks.compressed_decode import merge_rounds


def test_a_row_is_the_median_and_minimum_of_every_round_sample():
    rounds = [{"median_ms": 15.0, "min_ms": 14.0, "samples": [14.0, 15.0, 16.0], "ready_s": 50},
              {"error": ["did not finish in 900 s"]},
              {"median_ms": 12.0, "min_ms": 11.0, "samples": [11.0, 12.0, 13.0], "ready_s": 40}]
    row = merge_rounds(rounds)
    assert row["samples"] == [14.0, 15.0, 16.0, 11.0, 12.0, 13.0]
    assert (row["median_ms"], row["min_ms"], row["rounds"], row["ready_s"]) == (13.5, 11.0, 2, 40)


def test_a_configuration_that_failed_every_round_keeps_its_error():
    assert merge_rounds([{"error": ["exit 1"]}, {"error": ["exit 2"]}]) == {"error": ["exit 1"]}
