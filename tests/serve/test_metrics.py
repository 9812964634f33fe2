"""`/metrics`: the engine's speculative-decoding totals and the rates derived from them, and
vLLM's metric names (`vllm:*`) beside ours, with vLLM's types, label names and meanings."""

from __future__ import annotations

import json
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.cli import build_parser
from jaxinfer.engine.core import EngineStats
from jaxinfer.engine.host.draft import SpecStats
from serve.cli import service_config_from_args
from serve.metrics import ServingMetrics
from serve.service import ServiceConfig
from tests.serve.conftest import pool_is_full

ENGINE = ("model_name", "engine")
# vLLM's Prometheus metrics as vLLM 0.12 declares them: (name, type, label names). From
# PrometheusStatLogger in vllm/v1/metrics/loggers.py and SpecDecodingProm in
# vllm/v1/spec_decode/metrics.py (github.com/vllm-project/vllm), the source of the table at
# https://docs.vllm.ai/en/stable/usage/metrics/ . A counter's name is its family name: the
# exposition adds `_total` (vllm:prompt_tokens -> vllm:prompt_tokens_total).
VLLM_METRICS = [
    ("vllm:num_requests_running", "gauge", ENGINE),
    ("vllm:num_requests_waiting", "gauge", ENGINE),
    ("vllm:engine_sleep_state", "gauge", ENGINE + ("sleep_state",)),
    ("vllm:kv_cache_usage_perc", "gauge", ENGINE),
    ("vllm:corrupted_requests", "counter", ENGINE),
    ("vllm:prefix_cache_queries", "counter", ENGINE),
    ("vllm:prefix_cache_hits", "counter", ENGINE),
    ("vllm:external_prefix_cache_queries", "counter", ENGINE),
    ("vllm:external_prefix_cache_hits", "counter", ENGINE),
    ("vllm:mm_cache_queries", "counter", ENGINE),
    ("vllm:mm_cache_hits", "counter", ENGINE),
    ("vllm:num_preemptions", "counter", ENGINE),
    ("vllm:prompt_tokens", "counter", ENGINE),
    ("vllm:generation_tokens", "counter", ENGINE),
    ("vllm:request_success", "counter", ENGINE + ("finished_reason",)),
    ("vllm:request_prompt_tokens", "histogram", ENGINE),
    ("vllm:request_generation_tokens", "histogram", ENGINE),
    ("vllm:iteration_tokens_total", "histogram", ENGINE),
    ("vllm:request_max_num_generation_tokens", "histogram", ENGINE),
    ("vllm:request_params_n", "histogram", ENGINE),
    ("vllm:request_params_max_tokens", "histogram", ENGINE),
    ("vllm:time_to_first_token_seconds", "histogram", ENGINE),
    ("vllm:inter_token_latency_seconds", "histogram", ENGINE),
    ("vllm:request_time_per_output_token_seconds", "histogram", ENGINE),
    ("vllm:e2e_request_latency_seconds", "histogram", ENGINE),
    ("vllm:request_queue_time_seconds", "histogram", ENGINE),
    ("vllm:request_inference_time_seconds", "histogram", ENGINE),
    ("vllm:request_prefill_time_seconds", "histogram", ENGINE),
    ("vllm:request_decode_time_seconds", "histogram", ENGINE),
    ("vllm:kv_block_lifetime_seconds", "histogram", ENGINE),
    ("vllm:kv_block_idle_before_evict_seconds", "histogram", ENGINE),
    ("vllm:kv_block_reuse_gap_seconds", "histogram", ENGINE),
    ("vllm:lora_requests_info", "gauge",
     ("max_lora", "waiting_lora_adapters", "running_lora_adapters")),
    ("vllm:cache_config_info", "gauge", None),  # labels: vLLM's CacheConfig fields, "engine"
    ("vllm:spec_decode_num_drafts", "counter", ENGINE),
    ("vllm:spec_decode_num_draft_tokens", "counter", ENGINE),
    ("vllm:spec_decode_num_accepted_tokens", "counter", ENGINE),
    ("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", ENGINE + ("position",)),
]
# Names vLLM renamed that dashboards still read (same source, earlier releases): the KV-cache
# usage and prefix-cache counters before 0.9, the inter-token latency before 0.11.
VLLM_OLDER_NAMES = [
    ("vllm:gpu_cache_usage_perc", "gauge", ENGINE),
    ("vllm:gpu_prefix_cache_queries", "counter", ENGINE),
    ("vllm:gpu_prefix_cache_hits", "counter", ENGINE),
    ("vllm:time_per_output_token_seconds", "histogram", ENGINE),
]
# What we do not export, and why. (vLLM's KV-connector metrics, named by the connector in use,
# are left out too: we have no KV transfer between instances.)
NOT_EXPORTED = {
    # Features we do not have.
    "vllm:lora_requests_info": "no LoRA adapters",
    "vllm:mm_cache_queries": "no multi-modal models, so no multi-modal cache",
    "vllm:mm_cache_hits": "no multi-modal models, so no multi-modal cache",
    "vllm:external_prefix_cache_queries": "no KV connector (cross-instance cache sharing)",
    "vllm:external_prefix_cache_hits": "no KV connector (cross-instance cache sharing)",
    "vllm:corrupted_requests": "vLLM counts it only when told to scan logits for NaNs "
                               "(VLLM_COMPUTE_NANS_IN_LOGITS); our sampler does not scan",
    "vllm:cache_config_info": "its labels are vLLM's CacheConfig field names, which ours "
                              "(page_size, num_pages, ...) do not match",
    "vllm:kv_block_lifetime_seconds": "opt-in sampling of KV block residency in vLLM's block "
                                      "pool; our block pool keeps no block timestamps",
    "vllm:kv_block_idle_before_evict_seconds": "as vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_reuse_gap_seconds": "as vllm:kv_block_lifetime_seconds",
}
# Our series whose values the vLLM names must repeat (after the requests below).
SAME_VALUE = [
    ("vllm:num_requests_running", "jaxinfer:num_requests_running"),
    ("vllm:num_requests_waiting", "jaxinfer:num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "jaxinfer:kv_cache_usage_perc"),
    ("vllm:gpu_cache_usage_perc", "jaxinfer:kv_cache_usage_perc"),
    ("vllm:num_preemptions_total", "jaxinfer:num_preemptions"),
    ("vllm:spec_decode_num_drafts_total", "jaxinfer:spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens_total", "jaxinfer:spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens_total", "jaxinfer:spec_decode_num_accepted_tokens"),
    ("vllm:prompt_tokens_total", "jaxinfer:prompt_tokens_total"),
    ("vllm:generation_tokens_total", "jaxinfer:generation_tokens_total"),
    ("vllm:request_generation_tokens_sum", "jaxinfer:generation_tokens_total"),
    ("vllm:request_prompt_tokens_sum", "jaxinfer:prompt_tokens_total"),
    ("vllm:time_to_first_token_seconds_count", "jaxinfer:time_to_first_token_seconds_count"),
    ("vllm:time_to_first_token_seconds_sum", "jaxinfer:time_to_first_token_seconds_sum"),
    ("vllm:e2e_request_latency_seconds_count", "jaxinfer:e2e_request_latency_seconds_count"),
    ("vllm:e2e_request_latency_seconds_sum", "jaxinfer:e2e_request_latency_seconds_sum"),
    ("vllm:request_time_per_output_token_seconds_sum",
     "jaxinfer:time_per_output_token_seconds_sum"),
    ("vllm:time_per_output_token_seconds_sum", "vllm:inter_token_latency_seconds_sum"),
    ("vllm:gpu_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
]


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from:\n{text}")


def _samples(text: str, **labels: str) -> dict[str, float]:
    """Sample name -> value, summed over the series that carry `labels`."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if all(sample.labels.get(key) == value for key, value in labels.items()):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        return response.read().decode()


def _complete(port: int, **body) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps({"model": "demo", "temperature": 0, "ignore_eos": True, **body}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read()) if not body.get("stream") else {
            "chunks": response.read()}


def _wait_idle(service, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pool_is_full(service):
        assert time.monotonic() < deadline, "the engine did not drain"
        time.sleep(0.05)


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
    # vLLM's names: counters (the exposition says `_total`), labelled by model and engine.
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="demo"} 4.0' in text
    assert _value(text, "vllm:spec_decode_num_draft_tokens_total") == 12
    assert _value(text, "vllm:spec_decode_num_accepted_tokens_total") == 9


def test_host_kv_tier_series():
    stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                        prefix_cache_hit_rate=0.5, num_preemptions=0, num_steps=3,
                        prefix_cache_queries=400, prefix_cache_hits=200,
                        host_cache_queries=10, host_cache_hits=4, host_cache_hit_tokens=64,
                        kv_bytes_to_host=4096, kv_bytes_to_device=2048, kv_copy_seconds=0.25,
                        kv_copy_blocked_seconds=0.125)
    text = ServingMetrics(lambda: stats, "demo").render().decode()
    assert _value(text, "jaxinfer:host_cache_hit_rate") == 0.4
    assert _value(text, "jaxinfer:host_cache_token_hit_rate") == 0.16
    assert _value(text, "jaxinfer:host_cache_hit_tokens") == 64
    assert _value(text, "jaxinfer:kv_offload_bytes_to_host") == 4096
    assert _value(text, "jaxinfer:kv_offload_bytes_to_device") == 2048
    assert _value(text, "jaxinfer:kv_offload_copy_seconds") == 0.25
    assert _value(text, "jaxinfer:kv_offload_blocked_seconds") == 0.125


def test_accepted_drafts_per_position_and_steps_by_tokens():
    spec = SpecStats()
    for drafted, accepted in ((3, 3), (3, 1), (2, 0), (3, 2)):
        spec.add(drafted, accepted)
    assert spec.accepted_per_position == [3, 2, 1]  # stops at the first rejection
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                        prefix_cache_hit_rate=0.0, num_preemptions=0, num_steps=3,
                        num_spec_steps=4, num_draft_tokens=11, num_accepted_tokens=6,
                        accepted_per_position=tuple(spec.accepted_per_position),
                        iteration_tokens=(1, 1, 0, 0, 0, 1), iteration_tokens_sum=134)
    text = ServingMetrics(lambda: stats, "demo").render().decode()
    per_position = {int(position): _samples(text, position=position)[
        "vllm:spec_decode_num_accepted_tokens_per_pos_total"] for position in ("0", "1", "2")}
    assert per_position == {0: 3, 1: 2, 2: 1}
    samples = _samples(text, engine="0", model_name="demo")
    assert samples["vllm:iteration_tokens_total_count"] == 3
    assert samples["vllm:iteration_tokens_total_sum"] == 134
    buckets = {sample.labels["le"]: sample.value
               for family in text_string_to_metric_families(text)
               if family.name == "vllm:iteration_tokens_total"
               for sample in family.samples if sample.name.endswith("_bucket")}
    assert (buckets["1.0"], buckets["8.0"], buckets["64.0"], buckets["128.0"],
            buckets["+Inf"]) == (1, 2, 2, 3, 3)


def test_no_speculation_reports_zeros():
    stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                        prefix_cache_hit_rate=0.0, num_preemptions=0, num_steps=0)
    text = ServingMetrics(lambda: stats, "demo").render().decode()
    assert _value(text, "jaxinfer:spec_decode_acceptance_rate") == 0.0
    assert _value(text, "jaxinfer:spec_decode_mean_accepted_length") == 0.0


def test_engine_state_under_vllm_names_is_each_scrapes_snapshot():
    snapshots = iter([
        EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_hit_rate=0.5,
                    num_preemptions=1, num_steps=7, prefix_cache_queries=64,
                    prefix_cache_hits=32),
        EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_hit_rate=0.5,
                    num_preemptions=4, num_steps=9, prefix_cache_queries=96,
                    prefix_cache_hits=48)])
    metrics = ServingMetrics(lambda: next(snapshots), "demo")
    first = _samples(metrics.render().decode(), engine="0", model_name="demo")
    assert (first["vllm:num_requests_running"], first["vllm:num_requests_waiting"]) == (3, 2)
    assert first["vllm:kv_cache_usage_perc"] == first["vllm:gpu_cache_usage_perc"] == 0.25
    assert first["vllm:prefix_cache_queries_total"] == 64
    assert first["vllm:prefix_cache_hits_total"] == 32
    assert first["vllm:num_preemptions_total"] == 1
    second = _samples(metrics.render().decode(), engine="0", model_name="demo")
    assert second["vllm:num_requests_running"] == 0
    assert second["vllm:prefix_cache_queries_total"] == 96
    assert second["vllm:num_preemptions_total"] == 4


def test_vllm_names_are_exported_with_vllms_types_labels_and_our_values(server):
    service = server.server.service
    port = server.http_port
    _wait_idle(service)
    before = _samples(_scrape(port))
    # Every sample of a request runs to max_tokens (ignore_eos), so the counts are known.
    assert len(_complete(port, prompt="The list type", max_tokens=5, n=2)["choices"]) == 2
    _complete(port, prompt="Hello there", max_tokens=4)
    _complete(port, prompt="Streams too", max_tokens=3, stream=True)
    _wait_idle(service)
    text = _scrape(port)

    families = {family.name: family for family in text_string_to_metric_families(text)}
    exported = [entry for entry in VLLM_METRICS + VLLM_OLDER_NAMES
                if entry[0] not in NOT_EXPORTED]
    assert set(NOT_EXPORTED) <= {name for name, _, _ in VLLM_METRICS}
    for name, kind, labels in exported:
        assert name in families, f"{name} is missing from /metrics"
        family = families[name]
        assert family.type == kind, (name, family.type, kind)
        # Per draft position: one series per position drafted so far (none: no speculation).
        assert family.samples or name == "vllm:spec_decode_num_accepted_tokens_per_pos", name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(labels), (sample.name, sample.labels)
            assert sample.labels["model_name"] == "demo" and sample.labels["engine"] == "0"
    for name in NOT_EXPORTED:
        assert name not in families, f"{name} is exported: take it off NOT_EXPORTED"
    assert {sample.labels["finished_reason"] for sample in families["vllm:request_success"]
            .samples} >= {"stop", "length", "abort", "error"}

    now = _samples(text)
    for ours_vllm, ours in SAME_VALUE:
        assert now[ours_vllm] == now[ours] or abs(now[ours_vllm] - now[ours]) < 1e-9, (
            ours_vllm, now[ours_vllm], ours, now[ours])
    for reason in ("stop", "length", "abort"):
        assert (_samples(text, finished_reason=reason).get("vllm:request_success_total", 0)
                == _samples(text, finished_reason=reason).get(
                    "jaxinfer:request_success_total", 0))
    stats = service.engine.stats()
    assert now["vllm:prefix_cache_queries_total"] == stats.prefix_cache_queries
    assert now["vllm:prefix_cache_hits_total"] == stats.prefix_cache_hits
    # The sum of a request's inter-token gaps is its first token to its last.
    assert abs(now["vllm:inter_token_latency_seconds_sum"]
               - now["vllm:request_decode_time_seconds_sum"]) < 1e-6

    def grew(name: str) -> float:
        return now[name] - before.get(name, 0.0)

    assert grew("vllm:generation_tokens_total") == 2 * 5 + 4 + 3
    assert grew("vllm:request_params_n_count") == 3
    assert grew("vllm:request_params_n_sum") == 2 + 1 + 1
    assert grew("vllm:request_params_max_tokens_sum") == 5 + 4 + 3
    assert grew("vllm:request_max_num_generation_tokens_sum") == 5 + 4 + 3
    assert grew("vllm:request_generation_tokens_sum") == 2 * 5 + 4 + 3
    assert grew("vllm:request_prompt_tokens_count") == 3
    assert grew("vllm:request_decode_time_seconds_count") == 3
    # The engine's own phase times: every request was scheduled and generated.
    for phase in ("queue", "prefill", "inference"):
        assert grew(f"vllm:request_{phase}_time_seconds_count") == 3, phase
    assert now["vllm:request_inference_time_seconds_sum"] >= now[
        "vllm:request_prefill_time_seconds_sum"] > 0
    # Each engine step counted once, by the tokens it ran (the prompts' and the samples').
    assert grew("vllm:iteration_tokens_total_count") >= 5
    assert grew("vllm:iteration_tokens_total_sum") >= (
        grew("vllm:request_prompt_tokens_sum") + 2 * 5 + 4 + 3 - 3 - 1)
    # One gap per output that brings tokens after the request's first: at most one fewer
    # than the request's tokens (all samples together).
    assert 0 < grew("vllm:inter_token_latency_seconds_count") <= (2 * 5 - 1) + (4 - 1) + (3 - 1)


def test_vllm_names_can_be_turned_off():
    stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                        prefix_cache_hit_rate=0.0, num_preemptions=0, num_steps=0)
    metrics = ServingMetrics(lambda: stats, "demo", vllm_names=False)
    timer = metrics.start_request()
    timer.finish("stop", 3)
    text = metrics.render().decode()
    assert "jaxinfer:prompt_tokens_total" in text and "vllm:" not in text
    assert ServiceConfig(model_name="demo").vllm_metrics is True

    def config(*options: str) -> ServiceConfig:
        args = build_parser().parse_args(["serve", "--model", "builtin:demo", *options])
        return service_config_from_args(args, environ={})

    assert config().vllm_metrics is True
    assert config("--no-vllm-metrics").vllm_metrics is False
