"""ServingMetrics: what a request's outputs record, and vLLM's periodic stats line."""

import logging

import pytest
from prometheus_client import generate_latest

from minivllm.engine.async_llm import WireOutput, to_wire
from minivllm.engine.metrics import ServingMetrics, merged_registry
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _output(request_id: str, num_tokens: int, finish_reason: str | None, metrics: RequestMetrics) -> WireOutput:
    completion = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), None, None, finish_reason)
    return to_wire(RequestOutput(request_id, "p", [1, 2, 3], [completion], finish_reason is not None, metrics))


def test_outputs_feed_the_histograms_and_counters() -> None:
    stats = {"prefix_cache_queries": 10, "prefix_cache_hits": 4, "num_preemptions": 2, "num_free_blocks": 75,
             "num_blocks": 100, "num_running": 3, "num_waiting": 1}
    metrics = ServingMetrics("tiny", lambda: stats)
    timing = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5)
    metrics.on_request_added("a", 100.0, 3)
    metrics.on_outputs([_output("a", 1, None, timing)], now=101.0)  # TTFT 1 s, queued 0.5 s
    metrics.on_outputs([_output("a", 1, None, timing)], now=101.25)  # ITL 0.25 s
    metrics.on_outputs([_output("a", 2, "length", timing)], now=102.0)  # ITL 0.75 s, E2E 2 s
    metrics.on_outputs([_output("a", 5, None, timing)], now=103.0)  # finished already: left out
    metrics.on_request_added("b", 100.0, 3)
    metrics.on_request_aborted("b")
    text = generate_latest(metrics.registry).decode()

    def sample(line_start: str) -> float:
        (line,) = [line for line in text.splitlines() if line.startswith(line_start)]
        return float(line.rsplit(" ", 1)[1])

    assert sample('vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"}') == pytest.approx(1.0)
    assert sample('vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny"}') == 2
    assert sample('vllm:inter_token_latency_seconds_sum{engine="0",model_name="tiny"}') == pytest.approx(1.0)
    assert sample('vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"}') == pytest.approx(2.0)
    assert sample('vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"}') == pytest.approx(0.5)
    assert sample('vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}') == 1
    assert sample('vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}') == 1
    assert sample('vllm:generation_tokens_total{engine="0",model_name="tiny"}') == 4
    assert sample('vllm:prompt_tokens_total{engine="0",model_name="tiny"}') == 3
    assert sample('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}') == pytest.approx(0.25)
    assert sample('vllm:num_requests_running{engine="0",model_name="tiny"}') == 3
    assert sample('vllm:prefix_cache_hits_total{engine="0",model_name="tiny"}') == 4
    assert sample('vllm:num_preemptions_total{engine="0",model_name="tiny"}') == 2
    # The dashboard's recent latencies: TTFT at the first output, TPOT (after the first of its
    # 4 tokens) at the finish.
    assert list(metrics.recent_ttft) == [(101.0, pytest.approx(1.0))]
    assert list(metrics.recent_tpot) == [(102.0, pytest.approx(1.0 / 3))]


@pytest.mark.parametrize("device, cache_name", [("cuda", "GPU"), ("cpu", "CPU")])
def test_periodic_stats_line(caplog: pytest.LogCaptureFixture, device: str, cache_name: str) -> None:
    stats = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "num_free_blocks": 90,
             "num_blocks": 100, "num_running": 0, "num_waiting": 0}
    metrics = ServingMetrics("tiny", lambda: dict(stats), device)
    caplog.set_level(logging.INFO, logger="minivllm.stats")
    metrics.log_stats()  # the first call only sets the baseline
    metrics.log_stats()
    assert not caplog.records  # quiet while nothing happens
    metrics.on_request_added("a", 0.0, 3)
    metrics.on_outputs([_output("a", 5, None, RequestMetrics(arrival_time=0.0))], now=1.0)
    stats.update(prefix_cache_queries=100, prefix_cache_hits=25, num_running=2, num_waiting=1)
    metrics.log_stats()
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("Engine 000: ")  # vLLM's prefix: the engine's data-parallel rank
    for fragment in ("Avg prompt throughput:", "Avg generation throughput:", "Running: 2 reqs", "Waiting: 1 reqs",
                     f"{cache_name} KV cache usage: 10.0%", "Prefix cache hit rate: 25.0%"):
        assert fragment in message, (fragment, message)


def test_a_merged_registry_shows_each_metric_once_with_every_engine() -> None:
    stats = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "num_free_blocks": 90,
             "num_blocks": 100, "num_running": 0, "num_waiting": 0}
    engines = [ServingMetrics("tiny", lambda: stats, engine_index=i) for i in range(2)]
    engines[1].on_request_added("a", 0.0, 3)
    engines[1].on_outputs([_output("a", 2, "length", RequestMetrics(arrival_time=0.0))], now=1.0)
    text = generate_latest(merged_registry([engine.registry for engine in engines])).decode()
    assert text.count("# TYPE vllm:generation_tokens") == 1
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 0.0' in text
    assert 'vllm:generation_tokens_total{engine="1",model_name="tiny"} 2.0' in text
    assert text.count("# TYPE vllm:e2e_request_latency_seconds histogram") == 1
    assert 'vllm:e2e_request_latency_seconds_count{engine="1",model_name="tiny"} 1.0' in text


def test_histograms_expose_what_prometheus_client_exposes() -> None:
    """Our lock-free histogram's samples are prometheus_client's, bucket by bucket."""
    from prometheus_client import CollectorRegistry, Histogram

    from minivllm.engine.metrics import _ITL_BUCKETS, _Histogram

    values = [0.0, 0.01, 0.0100001, 0.3, 5.0, 79.0, 81.0, 1e-9]
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("vllm:x_seconds", "Doc.", ["model_name", "engine"], buckets=_ITL_BUCKETS,
                       registry=theirs_registry).labels("tiny", "0")
    ours = _Histogram("vllm:x_seconds", "Doc.", _ITL_BUCKETS, ["tiny", "0"], ours_registry)
    for value in values:
        theirs.observe(value)
    ours.observe_many(values[:3])
    for value in values[3:]:
        ours.observe(value)

    def samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for metric in registry.collect() for s in metric.samples
                if not s.name.endswith("_created")]

    assert samples(ours_registry) == samples(theirs_registry)
    assert generate_latest(ours_registry).decode().count("vllm:x_seconds_created") == \
        generate_latest(theirs_registry).decode().count("vllm:x_seconds_created")
