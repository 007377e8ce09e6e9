"""W3 — shared prefix (benchmarks/README.md): 256 requests share a 2,048-token prefix, each adds 64
distinct tokens and generates 128 (temperature 0.6, ignore_eos), run with prefix
caching on and off (a fresh engine each, freed in between).

    python -m benchmarks.prefix_cache --model qwen3-0.6b [--caching both|on|off] [--repeats 5]

A run lasts under a second, so each engine times --repeats runs, each on its own draw of
prefix and suffixes (so none finds an earlier run's prefix cached), and reports the median
run, with every run's tok/s beside it. Reports output tok/s both ways, their ratio, and the
hit rate over the timed run from llm.llm_engine.stats() (prompt tokens found cached /
prompt tokens looked up), next to the ideal: every request but the first finds the
prefix's full blocks. --step-breakdown: the first run's steps by kind, each kind's interval
between launches and device time per step (benchmarks.common.record_step_kinds).
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from benchmarks.common import (
    W1_TEMPERATURE,
    ModelSpec,
    Request,
    add_common_args,
    engine_stats,
    free_memory,
    make_llm,
    median_run,
    random_prompt,
    record_step_kinds,
    report,
    resolve_model,
    scaled,
    shutdown_llm,
    startup_metrics,
    stats_delta,
    timed_generate,
    warmup_llm,
)

W3_NUM_REQUESTS = 256
W3_PREFIX_LEN = 2048
W3_SUFFIX_LEN = 64
W3_OUTPUT_LEN = 128
DEFAULT_BLOCK_SIZE = 16  # the engine's default, for the ideal hit rate
PREFIX_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")  # tokens, from llm_engine.stats()


def w3_requests(scale: float, vocab_size: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    prefix = random_prompt(rng, scaled(W3_PREFIX_LEN, scale), vocab_size)
    return [Request(prefix + random_prompt(rng, scaled(W3_SUFFIX_LEN, scale), vocab_size),
                    scaled(W3_OUTPUT_LEN, scale))
            for _ in range(scaled(W3_NUM_REQUESTS, scale))]


def ideal_hit_rate(requests: list[Request], prefix_len: int, block_size: int) -> float:
    """Only full blocks are shared; the first request computes the prefix for the rest."""
    shared = prefix_len // block_size * block_size
    return (len(requests) - 1) * shared / sum(len(r.prompt_token_ids) for r in requests)


def run_engine(args: argparse.Namespace, spec: ModelSpec, caching: bool) -> dict[str, Any]:
    """A fresh engine, a warm-up that shares nothing with the workload, then --repeats timed
    runs (run r on w3_requests(seed=r)); the median run's metrics and every run's tok/s."""
    llm, startup = make_llm(args, spec, enable_prefix_caching=caching)
    warmup_llm(llm, spec.vocab_size, prefix_hit=True)
    started = startup_metrics(llm, startup)
    runs = []
    step_breakdown = {}
    for seed in range(args.repeats):
        before = engine_stats(llm)
        breakdown = record_step_kinds(llm) if args.step_breakdown and seed == 0 else None
        metrics = timed_generate(llm, w3_requests(args.scale, spec.vocab_size, seed), W1_TEMPERATURE)
        if breakdown is not None:
            step_breakdown = {"step_breakdown_run0": breakdown()}
        counters = stats_delta(before, engine_stats(llm), PREFIX_COUNTERS + ("num_preemptions",))
        metrics |= counters
        if all(k in counters for k in PREFIX_COUNTERS):
            queries, hits = (counters[k] for k in PREFIX_COUNTERS)
            metrics["hit_rate"] = hits / queries if queries else 0.0
        runs.append(metrics)
    shutdown_llm(llm)
    del llm
    free_memory()
    return median_run(runs) | started | step_breakdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--caching", default="both", choices=["both", "on", "off"])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per engine (the median is reported)")
    parser.add_argument("--step-breakdown", action="store_true",
                        help="time the first run's steps by kind, as benchmarks.throughput does")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    spec = resolve_model(args.model, args.load_format)
    requests = w3_requests(args.scale, spec.vocab_size)
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.caching]
    runs = {caching: run_engine(args, spec, caching) for caching in modes}

    summary: dict[str, Any] = {
        "num_requests": len(requests), "prefix_len": scaled(W3_PREFIX_LEN, args.scale),
        "ideal_hit_rate": ideal_hit_rate(requests, scaled(W3_PREFIX_LEN, args.scale),
                                         args.block_size or DEFAULT_BLOCK_SIZE)}
    for caching, metrics in runs.items():
        tag = "on" if caching else "off"
        summary |= {f"{tag}_{key}": value for key, value in metrics.items()
                    if key not in ("num_requests", "prompt_tokens", "expected_output_tokens")}
    if True in runs and "on_hit_rate" not in summary:
        summary["on_hit_rate"] = "n/a (the engine has no llm_engine.stats())"
    if len(runs) == 2:
        summary["speedup"] = runs[True]["output_tok_s"] / runs[False]["output_tok_s"]
    report("W3", "minivllm", args, summary)


if __name__ == "__main__":
    main()
