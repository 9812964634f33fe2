"""Prometheus metrics of one server, shared by its gRPC and HTTP front ends.

Two sets of names over the same observations:

- `jaxinfer:*`, named after vLLM's (`vllm:` becomes `jaxinfer:`), labelled `model_name`.
- `vllm:*` (`ServiceConfig.vllm_metrics`, on by default; `jaxinfer serve --no-vllm-metrics`
  turns them off): vLLM's own names, metric types, label names (`model_name`, `engine`,
  `finished_reason`, `sleep_state`) and bucket bounds, as vLLM 0.12's `PrometheusStatLogger`
  and `SpecDecodingProm` declare them, so a Grafana dashboard built for vLLM reads this server
  unchanged. The older names vLLM renamed (`vllm:gpu_cache_usage_perc`,
  `vllm:gpu_prefix_cache_{queries,hits}`, `vllm:time_per_output_token_seconds`) are exported
  too. tests/serve/test_metrics.py holds vLLM's list and says why each name missing here is.

Each `ServingMetrics` owns its own `CollectorRegistry`: two servers in one process (the tests
start several) never share counters. What mirrors the engine (running and waiting requests,
KV-cache usage, the prefix-cache and preemption totals, the speculative-decoding totals) is
read from `AsyncEngine.stats()` (a snapshot at most one engine step old, read without waiting)
once per scrape of `/metrics`, not pushed on every step. The `jaxinfer:` names expose the
engine's totals as gauges (and derive the acceptance rate and mean accepted length); the
`vllm:` names expose them as counters, as vLLM does, through a collector that builds its
families from that one snapshot. Everything else is observed as requests run (`RequestTimer`).

Where the `vllm:` series differ from vLLM's own:

- `engine` is always "0": a data-parallel engine reports its replicas summed.
- A request with n > 1 samples counts once (vLLM counts each sample as a request in
  `request_success`, `prompt_tokens` and the per-request histograms), and its inter-token
  latency is the gap between its outputs (all samples together), as its stream shows it.
- Time to first token, inter-token latency, end-to-end latency and decode time are taken
  where the server sees the outputs; queue, prefill and inference times come from the engine
  (`RequestOutput.times`: arrival, first step, first and last token), as vLLM's do.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from jaxinfer.engine.client import ITERATION_TOKEN_BUCKETS, EngineStats
from jaxinfer.engine.outputs import RequestOutput, RequestTimes
from jaxinfer.engine.sampling_params import RequestOutputKind, SamplingParams

# Seconds; from a few milliseconds (a cached decode step) to minutes (a long CPU generation).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                          0.4, 0.5, 0.75, 1.0, 2.5)

# vLLM's bucket bounds (so a dashboard's quantiles read the same): time to first token,
# inter-token latency, whole-request phases, and the `n` parameter.
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
_VLLM_LABELS = ("model_name", "engine")
_VLLM_ENGINE = "0"  # one series per engine in vLLM; ours is the whole (possibly DP) engine
# vLLM creates a request_success series for each of its finish reasons up front (at 0).
_VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")
# Token-count buckets when the context length is not given.
_DEFAULT_MAX_MODEL_LEN = 1 << 17

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... while <= `limit`: vLLM's token-count buckets."""
    bounds: list[int] = []
    scale = 1
    while scale <= limit:
        bounds += [step * scale for step in (1, 2, 5) if step * scale <= limit]
        scale *= 10
    return tuple(bounds)


class ServingMetrics:
    """The counters, gauges and histograms `/metrics` exposes.

    Args:
        stats: Returns the engine's current `EngineStats` (called at scrape time).
        model_name: The `model_name` label of every series.
        vllm_names: Also export vLLM's names (`vllm:*`) beside ours.
        max_model_len: The context length, which bounds vLLM's token-count buckets.
    """

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, *,
                 vllm_names: bool = True, max_model_len: int | None = None) -> None:
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
        # The host KV tier (`kv_offload_bytes`); all 0 while it is off.
        self.host_cache_hit_rate = gauge(
            "jaxinfer:host_cache_hit_rate",
            "Blocks found in the host KV tier over blocks looked up there (0 to 1).")
        self.host_cache_token_hit_rate = gauge(
            "jaxinfer:host_cache_token_hit_rate",
            "Admitted prompt tokens loaded from the host KV tier (0 to 1).")
        self.host_cache_hit_tokens = gauge(
            "jaxinfer:host_cache_hit_tokens",
            "Prompt tokens loaded from the host KV tier instead of recomputed.")
        self.kv_offload_bytes_to_host = gauge(
            "jaxinfer:kv_offload_bytes_to_host", "Bytes of KV blocks copied to host memory.")
        self.kv_offload_bytes_to_device = gauge(
            "jaxinfer:kv_offload_bytes_to_device", "Bytes of KV blocks copied back to devices.")
        self.kv_offload_copy_seconds = gauge(
            "jaxinfer:kv_offload_copy_seconds",
            "Engine-thread seconds spent issuing and collecting host KV copies.")
        self.kv_offload_blocked_seconds = gauge(
            "jaxinfer:kv_offload_blocked_seconds",
            "Of those, seconds waiting for a copy that had not overlapped the step.")
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
        # The series exist (at 0) from the start, as vLLM's do: a dashboard (or a scrape
        # before the first request) finds every name.
        for metric in (self.prompt_tokens, self.generation_tokens, self.time_to_first_token,
                       self.time_per_output_token, self.e2e_request_latency):
            metric.labels(**self._labels)
        self.vllm: VllmRequestMetrics | None = None
        self._vllm_engine: _VllmEngineCollector | None = None
        if vllm_names:
            self.vllm = VllmRequestMetrics(self.registry, model_name,
                                           max_model_len or _DEFAULT_MAX_MODEL_LEN)
            self._vllm_engine = _VllmEngineCollector(model_name)
            self.registry.register(self._vllm_engine)

    def reject(self, reason: str) -> None:
        """Counts a request refused with `reason` (invalid, overloaded, unauthenticated)."""
        self.requests_rejected.labels(model_name=self._labels["model_name"],
                                      reason=reason).inc()

    def start_request(self, params: SamplingParams | None = None) -> RequestTimer:
        """A timer for one request with `params`, started now."""
        return RequestTimer(self, params)

    def render(self) -> bytes:
        """The Prometheus text exposition, with the engine series refreshed from one
        `EngineStats` snapshot (the cost is per metric, never per request)."""
        stats = self._stats()
        for gauge, value in ((self.num_requests_running, stats.num_running),
                             (self.num_requests_waiting, stats.num_waiting),
                             (self.kv_cache_usage, stats.kv_cache_usage),
                             (self.prefix_cache_hit_rate, stats.prefix_cache_hit_rate),
                             (self.num_preemptions, stats.num_preemptions),
                             (self.host_cache_hit_rate, stats.host_cache_hit_rate),
                             (self.host_cache_token_hit_rate,
                              stats.host_cache_token_hit_rate),
                             (self.host_cache_hit_tokens, stats.host_cache_hit_tokens),
                             (self.kv_offload_bytes_to_host, stats.kv_bytes_to_host),
                             (self.kv_offload_bytes_to_device, stats.kv_bytes_to_device),
                             (self.kv_offload_copy_seconds, stats.kv_copy_seconds),
                             (self.kv_offload_blocked_seconds, stats.kv_copy_blocked_seconds),
                             (self.spec_decode_num_drafts, stats.num_spec_steps),
                             (self.spec_decode_num_draft_tokens, stats.num_draft_tokens),
                             (self.spec_decode_num_accepted_tokens, stats.num_accepted_tokens),
                             (self.spec_decode_acceptance_rate, stats.spec_acceptance_rate),
                             (self.spec_decode_mean_accepted_length,
                              stats.num_accepted_tokens / stats.num_spec_steps
                              if stats.num_spec_steps else 0.0)):
            gauge.labels(**self._labels).set(value)
        if self._vllm_engine is not None:
            self._vllm_engine.stats = stats
        return generate_latest(self.registry)


class VllmRequestMetrics:
    """vLLM's per-request series (`vllm:*`), bound to one model's labels up front so that
    recording an observation is one call.

    Args:
        registry: Where they are registered.
        model_name: The `model_name` label.
        max_model_len: Bounds the token-count buckets (vLLM's 1-2-5 series up to it).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 max_model_len: int) -> None:
        labels = {"model_name": model_name, "engine": _VLLM_ENGINE}
        self._labels = labels
        token_buckets = _one_two_five(max_model_len)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, _VLLM_LABELS,
                           registry=registry).labels(**labels)

        def histogram(name: str, documentation: str,
                      buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, _VLLM_LABELS, buckets=buckets,
                             registry=registry).labels(**labels)

        self.prompt_tokens = counter("vllm:prompt_tokens",
                                     "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Generated tokens of finished requests.")
        self._request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            (*_VLLM_LABELS, "finished_reason"), registry=registry)
        self.request_success = {reason: self._request_success.labels(
            finished_reason=reason, **labels) for reason in _VLLM_FINISH_REASONS}
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request.",
            token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Generated tokens of a finished request's longest sample.", token_buckets)
        self.request_params_n = histogram(
            "vllm:request_params_n", "The n request parameter.", _VLLM_N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.",
            token_buckets)
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Arrival to the first generated token.",
            _VLLM_TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between a request's successive outputs after its first token.",
            _VLLM_ITL_BUCKETS)
        # vLLM's name for the same series before 0.11 (still shown for older dashboards).
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Time between a request's successive outputs after its first token. "
            "DEPRECATED: use vllm:inter_token_latency_seconds.", _VLLM_ITL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per finished request.",
            _VLLM_ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to the end of the request.",
            _VLLM_REQUEST_BUCKETS)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "First generated token to the last, per finished request.", _VLLM_REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time a finished request waited before its first engine step.",
            _VLLM_REQUEST_BUCKETS)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "First engine step to first generated token, per finished request.",
            _VLLM_REQUEST_BUCKETS)
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "First engine step to last generated token, per finished request.",
            _VLLM_REQUEST_BUCKETS)

    def success(self, finish_reason: str) -> Counter:
        """The request_success series of `finish_reason`."""
        series = self.request_success.get(finish_reason)
        if series is None:  # a reason vLLM does not have: counted all the same
            series = self._request_success.labels(finished_reason=finish_reason,
                                                  **self._labels)
        return series


class _VllmEngineCollector:
    """vLLM's engine-state series (`vllm:*`), built at collection from the `EngineStats`
    snapshot `ServingMetrics.render` took: gauges for the current state, counters for the
    engine's running totals (which only grow, as a counter must)."""

    def __init__(self, model_name: str) -> None:
        self._values = [model_name, _VLLM_ENGINE]
        self.stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                 prefix_cache_hit_rate=0.0, num_preemptions=0, num_steps=0)

    def describe(self) -> Iterator[Metric]:
        """The families (names are checked against the registry's at registration)."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        """One family per vLLM name, from the latest snapshot."""
        stats = self.stats
        for name, documentation, value in (
                ("vllm:num_requests_running", "Sequences in the engine's running set.",
                 stats.num_running),
                ("vllm:num_requests_waiting", "Sequences waiting to be admitted.",
                 stats.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
                 stats.kv_cache_usage),
                ("vllm:gpu_cache_usage_perc", "KV-cache usage; 1 means 100 percent. "
                 "DEPRECATED: use vllm:kv_cache_usage_perc.", stats.kv_cache_usage)):
            family = GaugeMetricFamily(name, documentation, labels=_VLLM_LABELS)
            family.add_metric(self._values, value)
            yield family
        # The engine never sleeps (no weight offloading): always awake.
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state", "Engine sleep state; awake = 1 means awake.",
            labels=(*_VLLM_LABELS, "sleep_state"))
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.add_metric([*self._values, state], value)
        yield sleep
        for name, documentation, value in (
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 stats.prefix_cache_hits),
                ("vllm:gpu_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                 "cache. DEPRECATED: use vllm:prefix_cache_queries.",
                 stats.prefix_cache_queries),
                ("vllm:gpu_prefix_cache_hits", "Prompt tokens found in the prefix cache. "
                 "DEPRECATED: use vllm:prefix_cache_hits.", stats.prefix_cache_hits),
                ("vllm:num_preemptions", "Preemptions since the engine started.",
                 stats.num_preemptions),
                ("vllm:spec_decode_num_drafts", "Request-steps that verified drafts.",
                 stats.num_spec_steps),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                 stats.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 stats.num_accepted_tokens)):
            family = CounterMetricFamily(name, documentation, labels=_VLLM_LABELS)
            family.add_metric(self._values, value)
            yield family
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            labels=(*_VLLM_LABELS, "position"))
        for position, value in enumerate(stats.accepted_per_position):
            per_position.add_metric([*self._values, str(position)], value)
        yield per_position
        counts = stats.iteration_tokens or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
        cumulative = list(itertools.accumulate(counts))
        iteration = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Tokens run by each engine step.",
            labels=_VLLM_LABELS)
        iteration.add_metric(
            self._values,
            [(str(float(bound)), count) for bound, count in zip(ITERATION_TOKEN_BUCKETS,
                                                                cumulative)]
            + [("+Inf", cumulative[-1])], sum_value=stats.iteration_tokens_sum)
        yield iteration


class RequestTimer:
    """Times one request from arrival; `output()` on each output, `finish()` at the end.

    Args:
        metrics: Where the observations go.
        params: The request's parameters (n, max_tokens, and whether outputs are deltas);
            None: one sample, delta outputs, and no parameter histograms.
    """

    def __init__(self, metrics: ServingMetrics, params: SamplingParams | None = None) -> None:
        self._metrics = metrics
        self._vllm = metrics.vllm
        self._params = params
        self._delta = params is None or params.output_kind is RequestOutputKind.DELTA
        self._sample_tokens: dict[int, int] = {}  # sample index -> tokens generated
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.engine_times: RequestTimes | None = None  # the engine's own, latest seen

    def output(self, output: RequestOutput) -> None:
        """Records one of the request's outputs (a delta, or the whole state so far)."""
        if output.times is not None:
            self.engine_times = output.times
        counts = self._sample_tokens
        for sample in output.outputs:
            new = len(sample.token_ids)
            counts[sample.index] = counts.get(sample.index, 0) + new if self._delta else new
        total = sum(counts.values())
        if total <= self.num_tokens:
            return
        self.num_tokens = total
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self._metrics.time_to_first_token.labels(**self._metrics._labels).observe(
                now - self.arrival)
            if self._vllm is not None:
                self._vllm.time_to_first_token.observe(now - self.arrival)
        elif self._vllm is not None:
            assert self.last_token is not None
            self._vllm.inter_token_latency.observe(now - self.last_token)
            self._vllm.time_per_output_token.observe(now - self.last_token)
        self.last_token = now

    def finish(self, finish_reason: str, prompt_tokens: int) -> None:
        """Records the end of the request (any reason, "abort" included).

        Args:
            finish_reason: The request's finish reason.
            prompt_tokens: Its prompt's length; 0 when it ended before its first output
                (unknown: left out of the prompt-length histogram).
        """
        metrics = self._metrics
        labels = metrics._labels
        latency = time.perf_counter() - self.arrival
        tpot = None
        if self.first_token is not None and self.last_token is not None \
                and self.num_tokens > 1:
            tpot = (self.last_token - self.first_token) / (self.num_tokens - 1)
        metrics.e2e_request_latency.labels(**labels).observe(latency)
        if tpot is not None:
            metrics.time_per_output_token.labels(**labels).observe(tpot)
        metrics.prompt_tokens.labels(**labels).inc(prompt_tokens)
        metrics.generation_tokens.labels(**labels).inc(self.num_tokens)
        metrics.request_success.labels(finished_reason=finish_reason, **labels).inc()
        vllm = self._vllm
        if vllm is None:
            return
        vllm.e2e_request_latency.observe(latency)
        if tpot is not None:
            vllm.request_time_per_output_token.observe(tpot)
        if self.first_token is not None and self.last_token is not None:
            vllm.request_decode_time.observe(self.last_token - self.first_token)
        times = self.engine_times
        if times is not None:  # the phases inside the engine, as vLLM's engine times them
            for series, seconds in ((vllm.request_queue_time, times.queue_seconds),
                                    (vllm.request_prefill_time, times.prefill_seconds),
                                    (vllm.request_inference_time, times.inference_seconds)):
                if seconds is not None:
                    series.observe(seconds)
        vllm.prompt_tokens.inc(prompt_tokens)
        vllm.generation_tokens.inc(self.num_tokens)
        vllm.success(finish_reason).inc()
        if prompt_tokens:
            vllm.request_prompt_tokens.observe(prompt_tokens)
        vllm.request_generation_tokens.observe(self.num_tokens)
        vllm.request_max_num_generation_tokens.observe(
            max(self._sample_tokens.values(), default=0))
        if self._params is not None:
            vllm.request_params_n.observe(self._params.n)
            vllm.request_params_max_tokens.observe(self._params.max_tokens)
