"""Prometheus metrics of one server, shared by its gRPC and HTTP front ends.

Names follow vLLM's (`vllm:` becomes `jaxinfer:`), so existing dashboards need only the
prefix changed. Each `ServingMetrics` owns its own `CollectorRegistry`: two servers in one
process (the tests start several) never share counters. Gauges that mirror the engine (running
and waiting requests, KV-cache usage, prefix-cache hit rate, preemptions) are read from
`AsyncEngine.stats()` (a snapshot at most one engine step old, read without waiting) when
`/metrics` is scraped, not pushed on every step; so are the speculative-decoding totals
(vLLM's `spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`, exposed
as gauges mirroring the engine's counters) and the acceptance rate and mean accepted length
derived from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jaxinfer.engine.core import EngineStats

# Seconds; from a few milliseconds (a cached decode step) to minutes (a long CPU generation).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                          0.4, 0.5, 0.75, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServingMetrics:
    """The counters, gauges and histograms `/metrics` exposes.

    Args:
        stats: Returns the engine's current `EngineStats` (called at scrape time).
        model_name: The `model_name` label of every series.
    """

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._stats = stats
        self._labels = {"model_name": model_name}
        label = ["model_name"]

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, label, registry=self.registry)

        self.num_requests_running = gauge(
            "jaxinfer:num_requests_running", "Sequences in the engine's running set.")
        self.num_requests_waiting = gauge(
            "jaxinfer:num_requests_waiting", "Sequences waiting to be admitted.")
        self.kv_cache_usage = gauge(
            "jaxinfer:kv_cache_usage_perc", "Fraction of the KV page pool in use (0 to 1).")
        self.prefix_cache_hit_rate = gauge(
            "jaxinfer:prefix_cache_hit_rate", "Prompt tokens served by the prefix cache.")
        self.num_preemptions = gauge(
            "jaxinfer:num_preemptions", "Preemptions since the engine started.")
        self.spec_decode_num_drafts = gauge(
            "jaxinfer:spec_decode_num_drafts",
            "Request-steps that verified speculative drafts, since the engine started.")
        self.spec_decode_num_draft_tokens = gauge(
            "jaxinfer:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = gauge(
            "jaxinfer:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_decode_acceptance_rate = gauge(
            "jaxinfer:spec_decode_acceptance_rate", "Accepted over drafted tokens (0 to 1).")
        self.spec_decode_mean_accepted_length = gauge(
            "jaxinfer:spec_decode_mean_accepted_length",
            "Accepted drafts per verification step (each such step emits one more token).")
        self.prompt_tokens = Counter(
            "jaxinfer:prompt_tokens", "Prompt tokens of finished requests.", label,
            registry=self.registry)
        self.generation_tokens = Counter(
            "jaxinfer:generation_tokens", "Generated tokens of finished requests.", label,
            registry=self.registry)
        self.request_success = Counter(
            "jaxinfer:request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.requests_rejected = Counter(
            "jaxinfer:requests_rejected", "Requests refused before reaching the engine.",
            ["model_name", "reason"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "jaxinfer:time_to_first_token_seconds", "Arrival to first generated token.",
            label, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            "jaxinfer:time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.", label,
            buckets=_TOKEN_LATENCY_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            "jaxinfer:e2e_request_latency_seconds", "Arrival to the last token.", label,
            buckets=_LATENCY_BUCKETS, registry=self.registry)

    def reject(self, reason: str) -> None:
        """Counts a request refused with `reason` (invalid, overloaded, unauthenticated)."""
        self.requests_rejected.labels(model_name=self._labels["model_name"],
                                      reason=reason).inc()

    def start_request(self) -> RequestTimer:
        """A timer for one request, started now."""
        return RequestTimer(self)

    def render(self) -> bytes:
        """The Prometheus text exposition, with the engine gauges refreshed."""
        stats = self._stats()
        for gauge, value in ((self.num_requests_running, stats.num_running),
                             (self.num_requests_waiting, stats.num_waiting),
                             (self.kv_cache_usage, stats.kv_cache_usage),
                             (self.prefix_cache_hit_rate, stats.prefix_cache_hit_rate),
                             (self.num_preemptions, stats.num_preemptions),
                             (self.spec_decode_num_drafts, stats.num_spec_steps),
                             (self.spec_decode_num_draft_tokens, stats.num_draft_tokens),
                             (self.spec_decode_num_accepted_tokens, stats.num_accepted_tokens),
                             (self.spec_decode_acceptance_rate, stats.spec_acceptance_rate),
                             (self.spec_decode_mean_accepted_length,
                              stats.num_accepted_tokens / stats.num_spec_steps
                              if stats.num_spec_steps else 0.0)):
            gauge.labels(**self._labels).set(value)
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request from arrival; `token()` on each new output, `finish()` at the end."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._metrics = metrics
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.num_tokens = 0

    def tokens(self, total_generated: int) -> None:
        """Records that the request has now generated `total_generated` tokens."""
        if total_generated > 0 and self.first_token is None:
            self.first_token = time.perf_counter()
            self._metrics.time_to_first_token.labels(**self._metrics._labels).observe(
                self.first_token - self.arrival)
        self.num_tokens = total_generated

    def finish(self, finish_reason: str, prompt_tokens: int) -> None:
        """Records the end of the request (any reason, "abort" included)."""
        labels = self._metrics._labels
        now = time.perf_counter()
        self._metrics.e2e_request_latency.labels(**labels).observe(now - self.arrival)
        if self.first_token is not None and self.num_tokens > 1:
            self._metrics.time_per_output_token.labels(**labels).observe(
                (now - self.first_token) / (self.num_tokens - 1))
        self._metrics.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self._metrics.generation_tokens.labels(**labels).inc(self.num_tokens)
        self._metrics.request_success.labels(finished_reason=finish_reason, **labels).inc()
