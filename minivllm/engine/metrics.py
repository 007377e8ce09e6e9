"""Serving metrics under vLLM's Prometheus names (so existing dashboards work), and the
periodic stats log line vLLM prints.

Request-level figures (latencies, finish reasons, token counts) are recorded on the event
loop as outputs arrive there; engine-level ones (running, waiting, KV-cache usage, prefix
cache, preemptions) are read from the engine when /metrics is scraped.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from minivllm.engine.async_llm import WireOutput

logger = logging.getLogger("minivllm.stats")

EngineStats = dict[str, int]
# A request as the dashboard lists it: (request_id, state ("waiting", "running" or "preempted"),
# prompt tokens, generated tokens (all samples'), arrival time (time.time())).
RequestRow = tuple[str, str, int, int, float]


@dataclass(slots=True)
class EngineSnapshot:
    """What the engine core sends the dashboard, when asked (at most once a second, while one
    is open): built from the state it keeps anyway."""

    stats: EngineStats  # LLMEngine.stats, of the same moment
    block_states: bytes  # KVCacheManager.block_states
    block_size: int
    num_preempted: int  # waiting sequences that were preempted
    num_requests: int  # unfinished
    requests: list[RequestRow]  # the oldest unfinished ones, at most MAX_LISTED_REQUESTS


MAX_LISTED_REQUESTS = 100

# Every metric's labels, as vLLM's: the served model's name and the engine's data-parallel rank.
_LABELS = ["model_name", "engine"]

# vLLM's latency buckets (seconds).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# Latencies kept for the dashboard's plots (one a request, of the last minutes).
RECENT_LATENCIES = 20_000


@dataclass(slots=True)
class _Request:
    """What the metrics keep of an unfinished request."""

    arrival_time: float
    num_prompt_tokens: int
    first_output_time: float = 0.0  # set with the first output
    last_output_time: float | None = None  # None before its first output
    num_generation_tokens: int = 0


class ServingMetrics:
    def __init__(self, model_name: str, read_engine_stats: Callable[[], EngineStats], device: str = "cuda",
                 engine_index: int = 0) -> None:
        """device: where the KV cache lives, "cuda" or "cpu" (the log line names it);
        engine_index: the engine's data-parallel rank (vLLM's `engine` label, and the log line's)."""
        # A registry of our own: several engines in one process (tests) must not collide.
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine_index = engine_index
        self.label_values = [model_name, str(engine_index)]  # for _LABELS
        self.kv_cache_device = "GPU" if device == "cuda" else device.upper()
        self._read_engine_stats = read_engine_stats
        self.ttft = _Histogram("vllm:time_to_first_token_seconds", "Time to first token, seconds.",
                               _TTFT_BUCKETS, self.label_values, self.registry)
        self.itl = _Histogram("vllm:inter_token_latency_seconds", "Time between output tokens, seconds.",
                              _ITL_BUCKETS, self.label_values, self.registry)
        self.e2e = _Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                              _REQUEST_BUCKETS, self.label_values, self.registry)
        self.queue_time = _Histogram("vllm:request_queue_time_seconds", "Time spent waiting to be scheduled.",
                                     _REQUEST_BUCKETS, self.label_values, self.registry)
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       [*_LABELS, "finished_reason"], registry=self.registry)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._requests: dict[str, _Request] = {}  # unfinished ones
        # (when, seconds) of recent requests: time to first token, and time per output token
        # after the first (vLLM's TPOT), for the dashboard.
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=RECENT_LATENCIES)
        self.recent_tpot: deque[tuple[float, float]] = deque(maxlen=RECENT_LATENCIES)
        self._last_log: tuple[float, int, int, int, int] | None = None
        self._last_spec_decode_log: EngineStats = {}  # speculative decoding's counts at the last line
        self.registry.register(_EngineCollector(self))

    # --- recorded on the event loop ---------------------------------------------------------

    def on_request_added(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _Request(arrival_time, num_prompt_tokens)

    def on_outputs(self, outputs: list[WireOutput], now: float) -> None:
        """Record outputs that arrived at `now`: a step's, one per stream (so once per token).
        Those of requests not added, or finished or aborted already, are left out."""
        requests = self._requests
        inter_token_latencies = []
        num_tokens = 0
        for request_id, completions, finished, times, _, _ in outputs:
            request = requests.get(request_id)
            if request is None:
                continue
            request_tokens = 0
            for _, _, token_ids, _, _, _, _ in completions:  # CompletionOutput's fields
                request_tokens += len(token_ids)
            num_tokens += request_tokens
            request.num_generation_tokens += request_tokens
            if request.last_output_time is None:
                self._first_output(request, times[0], now)  # times[0]: when it was first scheduled
            else:
                inter_token_latencies.append(now - request.last_output_time)
            request.last_output_time = now
            if finished:
                del requests[request_id]
                self.e2e.observe(now - request.arrival_time)
                if request.num_generation_tokens > 1:
                    self.recent_tpot.append(
                        (now, (now - request.first_output_time) / (request.num_generation_tokens - 1)))
                _, _, _, _, _, finish_reason, _ = completions[0]  # vLLM counts the first sample's
                self.request_success.labels(*self.label_values, finish_reason).inc()
        self.itl.observe_many(inter_token_latencies)
        self.num_generation_tokens += num_tokens

    def _first_output(self, request: _Request, first_scheduled_time: float | None, now: float) -> None:
        request.first_output_time = now
        self.ttft.observe(now - request.arrival_time)
        self.recent_ttft.append((now, now - request.arrival_time))
        if first_scheduled_time is not None:
            self.queue_time.observe(first_scheduled_time - request.arrival_time)
        self.num_prompt_tokens += request.num_prompt_tokens

    def on_request_aborted(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.request_success.labels(*self.label_values, "abort").inc()

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
        logger.info("Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, %s KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    self.engine_index, prompt / elapsed, generation / elapsed, stats["num_running"],
                    stats["num_waiting"], self.kv_cache_device,
                    100 * kv_cache_usage(stats), 100 * hits / queries if queries else 0.0)
        if "spec_decode_num_drafts" in stats:
            self._log_spec_decode_stats(stats, elapsed)

    def _log_spec_decode_stats(self, stats: EngineStats, elapsed: float) -> None:
        """vLLM's speculative-decoding line, over the drafts since the last one (none: no line).
        The mean acceptance length counts the token each verifying row adds after its drafts."""
        counts = {name: value for name, value in stats.items() if name.startswith("spec_decode_")}
        previous, self._last_spec_decode_log = self._last_spec_decode_log, counts
        new = {name: value - previous.get(name, 0) for name, value in counts.items()}
        num_drafts, drafted = new["spec_decode_num_drafts"], new["spec_decode_num_draft_tokens"]
        if not num_drafts:
            return
        accepted = new["spec_decode_num_accepted_tokens"]
        per_position = ", ".join(f"{new[f'spec_decode_num_accepted_tokens_pos{i}'] / num_drafts:.3f}"
                                 for i in range(len(_per_position_counts(stats))))
        logger.info("Engine %03d: SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
                    "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                    "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                    self.engine_index, 1 + accepted / num_drafts, accepted / elapsed, drafted / elapsed, accepted,
                    drafted, per_position, 100 * accepted / drafted)


class _Histogram(Collector):
    """A Prometheus histogram of one engine's values (label_values: those of _LABELS), exposed
    as prometheus_client's Histogram exposes one. Observed on the event loop only, so without
    the locks that Histogram takes per observation: the inter-token one records every
    streamed token."""

    def __init__(self, name: str, documentation: str, buckets: list[float], label_values: list[str],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.label_values = label_values
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many([value])

    def observe_many(self, values: list[float]) -> None:
        counts, bounds = self._counts, self._bounds
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # the first bound >= value
        self._sum += sum(values)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=_LABELS)
        cumulative = itertools.accumulate(self._counts)
        family.add_metric(self.label_values, [(floatToGoString(b), c) for b, c in zip(self._bounds, cumulative)],
                          self._sum)
        family.samples.append(Sample(f"{self.name}_created", dict(zip(_LABELS, self.label_values)), self._created))
        yield family


def _per_position_counts(stats: EngineStats) -> list[int]:
    """Speculative decoding's accepted tokens at each draft position (LLMEngine.stats)."""
    counts: list[int] = []
    while (count := stats.get(f"spec_decode_num_accepted_tokens_pos{len(counts)}")) is not None:
        counts.append(count)
    return counts


def kv_cache_usage(stats: EngineStats) -> float:
    """The fraction of KV blocks in use (free blocks that still hold cached prefixes count as free)."""
    return 1.0 - stats["num_free_blocks"] / stats["num_blocks"]


class _EngineCollector(Collector):
    """Engine state and running counts, read when /metrics is scraped."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.metrics._read_engine_stats()
        label_values = self.metrics.label_values

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=_LABELS)
            family.add_metric(label_values, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=_LABELS)
            family.add_metric(label_values, value)
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
        if "spec_decode_num_drafts" in stats:  # speculative decoding's, as vLLM's
            yield counter("vllm:spec_decode_num_drafts", "Rows that verified draft tokens.",
                          stats["spec_decode_num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                          stats["spec_decode_num_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          stats["spec_decode_num_accepted_tokens"])
            per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                               "Draft tokens accepted, by draft position.",
                                               labels=[*_LABELS, "position"])
            for position, count in enumerate(_per_position_counts(stats)):
                per_position.add_metric([*label_values, str(position)], count)
            yield per_position


def merged_registry(registries: list[CollectorRegistry]) -> CollectorRegistry:
    """One registry exposing each metric of `registries` once, with the samples of all (data-
    parallel engines' metrics, told apart by their engine label)."""
    merged = CollectorRegistry()
    merged.register(_MergedCollector(registries))
    return merged


class _MergedCollector(Collector):
    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()
