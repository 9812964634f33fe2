"""The pruning page's words follow its numbers: misses are named with their reasons, and a
run's JSON (string keys) renders the same tables as the run itself."""

from __future__ import annotations

import json

from benchmarks.pruning_markdown import _speed_misses, _step_floor, acceptance, misses


def _sweep(dense: float, fifty: dict[str, float], seventy: dict[str, float]) -> dict:
    rows = [{"method": method, "owl": owl, "ppl": {"0.5": fifty[method] + 0.01 * owl,
                                                   "0.7": seventy[method]}}
            for method in ("magnitude", "wanda", "sparsegpt") for owl in (False, True)]
    return {"dense_ppl": dense, "rows": rows, "parameters": 135e6,
            "input_norms": {"max_over_median": 1.9}}


def _structured() -> dict:
    speeds = {"dense": {"1": 100.0, "32": 1000.0}, "pruned": {"1": 133.0, "32": 1200.0}}
    return {"dense_parameters": 1000, "pruned_parameters": 750,
            "decode_tokens_per_s": speeds}


def test_every_figure_holding_says_so():
    results = {"demo": _sweep(10.0, {"magnitude": 20.0, "wanda": 12.0, "sparsegpt": 11.0},
                              {"magnitude": 40.0, "wanda": 20.0, "sparsegpt": 15.0})}
    assert misses(results) == ["Every quality figure above holds."]


def test_a_miss_against_magnitude_and_against_dense_each_get_a_reason():
    results = {
        "demo": _sweep(10.0, {"magnitude": 10.4, "wanda": 10.4, "sparsegpt": 10.1},
                       {"magnitude": 14.0, "wanda": 13.0, "sparsegpt": 11.0}),
        "smollm2": _sweep(10.0, {"magnitude": 100.0, "wanda": 19.0, "sparsegpt": 14.0},
                          {"magnitude": 900.0, "wanda": 90.0, "sparsegpt": 40.0}),
    }
    lines = misses(results)
    assert len(lines) == 2
    assert lines[0].startswith("- **demo, wanda at 50%")
    assert "at 70%, wanda's increase is 0.75 of magnitude's" in lines[0]
    assert lines[1].startswith("- **smollm2, wanda at 50%: 1.90x dense")
    assert "gives 1.40x and meets the target" in lines[1]


def test_speed_up_rows_and_step_floor_read_json_keys():
    results = json.loads(json.dumps({"structured": _structured()}))
    rows = acceptance(results)
    assert "| structured, demo: decode speed-up @ 1 | follows 1 / (1 - 25.0%) = 1.33x | "\
        "1.33x | 100% of it; see the section |" in rows
    assert "1.20x | 90% of it" in rows[-1]
    floor = _step_floor(results["structured"], read_gb_per_s=4.0)
    assert floor[0].startswith("- dense: ms per decode step @ 1: 10.00 ms, @ 32: 32.00 ms")


def test_a_speed_up_short_of_its_ideal_is_set_against_the_weights_roofline():
    structured = _structured()
    structured["decode_tokens_per_s"]["pruned"]["32"] = 1150.0
    results = json.loads(json.dumps({
        "structured": structured,
        "timed_phase": {"read_gb_per_s": 4.0, "matmul_gflops": 1.0},
        "harp": {"prefill_s": {"dense": 1.0, "top 1": 1.1, "top 2": 0.8}},
    }))
    lines = _speed_misses(results)
    # @ 1 holds (1.33x of 1.33x); @ 32 (1.15x) is under 90% of it. Dense step at 32:
    # 32 ms; weights 1000 * 4 B at 4 GB/s = 0.001 ms, FLOPs 2 * 1000 * 32 at 1 GFLOP/s =
    # 0.064 ms: pruning a quarter of them leaves 32 / (32 - 0.016) = 1.00x.
    assert len(lines) == 2
    assert lines[0].startswith("- **demo, decode @ 32: 1.15x against the ideal 1.33x.**")
    assert "gives 1.00x" in lines[0]
    assert lines[1].startswith("- **HARP top 1: prefill 1.10x") and "top 2 0.80x" in lines[1]
