"""Serving metrics under vLLM's Prometheus names (so existing dashboards work), and the
periodic stats log line vLLM prints.

Request-level figures (latencies, finish reasons, token counts) are recorded on the event
loop as outputs arrive there; engine-level ones (running, waiting, KV-cache usage, prefix
cache, preemptions) are read from the engine when /metrics is scraped.
"""

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minivllm.outputs import RequestOutput

logger = logging.getLogger("minivllm.stats")

EngineStats = dict[str, int]

# vLLM's latency buckets (seconds).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class ServingMetrics:
    def __init__(self, model_name: str, read_engine_stats: Callable[[], EngineStats]) -> None:
        # A registry of our own: several engines in one process (tests) must not collide.
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._read_engine_stats = read_engine_stats
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, seconds.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens, seconds.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                             labels, buckets=_REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time spent waiting to be scheduled.",
                                    labels, buckets=_REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Per unfinished request: when its last output arrived (None before the first).
        self._last_output_time: dict[str, float | None] = {}
        self._last_log: tuple[float, int, int, int, int] | None = None
        self.registry.register(_EngineCollector(self))

    # --- recorded on the event loop ---------------------------------------------------------

    def on_request_added(self, request_id: str) -> None:
        self._last_output_time[request_id] = None

    def on_output(self, output: RequestOutput, now: float) -> None:
        last = self._last_output_time.get(output.request_id)
        metrics = output.metrics
        if last is None:
            self.ttft.observe(now - metrics.arrival_time)
            if metrics.first_scheduled_time is not None:
                self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
            self.num_prompt_tokens += len(output.prompt_token_ids)
        else:
            self.itl.observe(now - last)
        self.num_generation_tokens += sum(len(c.token_ids) for c in output.outputs)
        if output.finished:
            self._last_output_time.pop(output.request_id, None)
            self.e2e.observe(now - metrics.arrival_time)
            self.request_success.labels(self.model_name, output.outputs[0].finish_reason).inc()
        else:
            self._last_output_time[output.request_id] = now

    def on_request_aborted(self, request_id: str) -> None:
        self._last_output_time.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()

    # --- the periodic log line --------------------------------------------------------------

    def log_stats(self) -> None:
        """vLLM's periodic line: throughputs since the last line, queue sizes, cache use.
        Quiet while nothing happens."""
        stats = self._read_engine_stats()
        now = time.monotonic()
        current = (now, self.num_prompt_tokens, self.num_generation_tokens,
                   stats["prefix_cache_queries"], stats["prefix_cache_hits"])
        previous, self._last_log = self._last_log, current
        if previous is None:
            return
        elapsed = max(now - previous[0], 1e-9)
        prompt, generation, queries, hits = (c - p for c, p in zip(current[1:], previous[1:]))
        if not (prompt or generation or stats["num_running"] or stats["num_waiting"]):
            return
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    prompt / elapsed, generation / elapsed, stats["num_running"], stats["num_waiting"],
                    100 * kv_cache_usage(stats), 100 * hits / queries if queries else 0.0)


def kv_cache_usage(stats: EngineStats) -> float:
    """The fraction of KV blocks in use (free blocks that still hold cached prefixes count as free)."""
    return 1.0 - stats["num_free_blocks"] / stats["num_blocks"]


class _EngineCollector(Collector):
    """Engine state and running counts, read when /metrics is scraped."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.metrics._read_engine_stats()
        name = [self.metrics.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests being generated.", stats["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", kv_cache_usage(stats))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats["prefix_cache_queries"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats["prefix_cache_hits"])
        yield counter("vllm:num_preemptions", "Preempted sequences.", stats["num_preemptions"])
        yield counter("vllm:prompt_tokens", "Prompt tokens of requests that started generating.",
                      self.metrics.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Generated tokens.", self.metrics.num_generation_tokens)
