"""`/metrics` exposes the engine's speculative-decoding totals and the rates derived from them."""

from __future__ import annotations

from jaxinfer.engine.core import EngineStats
from serve.metrics import ServingMetrics


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from:\n{text}")


def test_speculative_decoding_series():
    stats = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.5,
                        prefix_cache_hit_rate=0.0, num_preemptions=0, num_steps=10,
                        num_spec_steps=4, num_draft_tokens=12, num_accepted_tokens=9)
    text = ServingMetrics(lambda: stats, "demo").render().decode()
    assert _value(text, "jaxinfer:spec_decode_num_drafts") == 4
    assert _value(text, "jaxinfer:spec_decode_num_draft_tokens") == 12
    assert _value(text, "jaxinfer:spec_decode_num_accepted_tokens") == 9
    assert _value(text, "jaxinfer:spec_decode_acceptance_rate") == 0.75
    assert _value(text, "jaxinfer:spec_decode_mean_accepted_length") == 2.25


def test_no_speculation_reports_zeros():
    stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                        prefix_cache_hit_rate=0.0, num_preemptions=0, num_steps=0)
    text = ServingMetrics(lambda: stats, "demo").render().decode()
    assert _value(text, "jaxinfer:spec_decode_acceptance_rate") == 0.0
    assert _value(text, "jaxinfer:spec_decode_mean_accepted_length") == 0.0
