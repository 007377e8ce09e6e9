"""W4 — online serving: load an OpenAI-compatible server as `vllm bench serve` does.

    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --model m --tokenizer DIR \\
        --max-concurrency 64 --num-prompts 640 --num-warmups 16
    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --model m --tokenizer DIR --w4

For machines without vLLM; the server is minivllm's (`python -m minivllm serve MODEL_DIR
--served-model-name m ...`) or vLLM's. The prompts are vLLM's random dataset, drawn as vLLM
0.20 draws it (the same texts for the same seed and tokenizer), sent as text to
/v1/completions (ignore_eos, temperature 0, streamed with usage). The figures are vLLM's:
TTFT = first token event - send; ITL = gaps between token events, pooled; E2EL = last token
event - send; TPOT = (E2EL - TTFT) / (output tokens - 1) for requests with more than one;
token counts from the server's usage chunk; throughputs over the wall time of the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from benchmarks.common import environment


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_len: int  # tokens, by the client's tokenizer (the server's usage count replaces it)
    output_len: int  # max_tokens


@dataclass(frozen=True)
class Regime:
    num_prompts: int
    max_concurrency: int | None  # None: no limit
    request_rate: float  # Poisson arrivals per second; inf: all at once


# BENCH.md's W4, as ../shared/peer/vllm_w4.sh runs it.
W4_REGIMES = (Regime(64, 1, math.inf), Regime(640, 64, math.inf), Regime(1000, None, math.inf))
W4_WARMUPS = 16


@dataclass
class RequestResult:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    start: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        return np.diff(self.token_times).tolist()


# ----------------------------------------------------------------------------- workload


def random_prompts(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float, seed: int) -> list[Prompt]:
    """vLLM's RandomDataset.sample (no prefix): lengths uniform in [floor(n(1-r)), ceil(n(1+r))];
    prompt i is the non-special token ids in order from a random offset + i, decoded to text."""
    rng = np.random.default_rng(seed)
    real_input_len = max(0, input_len - tokenizer.num_special_tokens_to_add())
    input_lens = rng.integers(math.floor(real_input_len * (1 - range_ratio)),
                              math.ceil(real_input_len * (1 + range_ratio)) + 1, size=num_prompts)
    output_lens = rng.integers(max(1, math.floor(output_len * (1 - range_ratio))),
                               max(1, math.ceil(output_len * (1 + range_ratio))) + 1, size=num_prompts)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_prompts)
    allowed = np.array(sorted(set(range(tokenizer.vocab_size)) - set(tokenizer.all_special_ids)))
    prompts = []
    for i, (length, max_tokens, offset) in enumerate(zip(input_lens, output_lens, offsets)):
        ids = allowed[(offset + i + np.arange(length)) % len(allowed)].tolist()
        text, ids = decode_to_length(tokenizer, ids, int(length), rng)
        prompts.append(Prompt(text, len(ids), int(max_tokens)))
    return prompts


def decode_to_length(tokenizer: Any, ids: list[int], target: int,
                     rng: np.random.Generator) -> tuple[str, list[int]]:
    """Decoded text whose re-encoding has `target` tokens: decode and re-encode, cutting or
    padding with random ids, at most 10 rounds (vLLM's gen_prompt_decode_to_target_len)."""
    for attempt in range(11):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target or attempt == 10:
            break
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids += rng.integers(0, tokenizer.vocab_size, size=target - len(ids)).tolist()
    return text, ids


def arrival_times(num_prompts: int, request_rate: float, seed: int) -> np.ndarray:
    """Send times (s after the start): all 0 for rate inf, else Poisson arrivals drawn as vLLM
    draws them (np.random.seed(seed), exponential gaps) and scaled to end at N / rate."""
    if math.isinf(request_rate):
        return np.zeros(num_prompts)
    times = np.cumsum(np.random.RandomState(seed).gamma(1.0, 1.0 / request_rate, num_prompts))
    return times * (num_prompts / request_rate) / times[-1]


# ------------------------------------------------------------------------------- client


def make_client() -> httpx.AsyncClient:
    """One client for the whole run: no pool limit (the regime's semaphore bounds the
    requests in flight), no timeout, $OPENAI_API_KEY as the bearer token if set."""
    key = os.environ.get("OPENAI_API_KEY")
    return httpx.AsyncClient(timeout=None, headers={"Authorization": f"Bearer {key}"} if key else None,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def send_request(client: httpx.AsyncClient, url: str, model: str, prompt: Prompt) -> RequestResult:
    """One streamed completion: the arrival time of each token event (any event with a choice,
    its text possibly empty, as vLLM counts), and the usage chunk's counts."""
    payload = {"model": model, "prompt": prompt.text, "max_tokens": prompt.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(start=time.perf_counter(), prompt_tokens=prompt.prompt_len)
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):  # blank separators, ": ping" comments
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {event['error']}"
                    return result
                if event.get("choices"):
                    result.token_times.append(time.perf_counter())
                elif usage := event.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens", prompt.prompt_len)
                    result.output_tokens = usage["completion_tokens"]
    except (httpx.HTTPError, OSError, ValueError) as error:
        result.error = repr(error)
        return result
    if not result.token_times:
        result.error = "the stream had no token event"
    result.output_tokens = result.output_tokens or len(result.token_times)
    return result


async def run_regime(client: httpx.AsyncClient, base_url: str, model: str, prompts: list[Prompt],
                     regime: Regime, seed: int = 0,
                     percentiles: tuple[float, ...] = (50, 90, 99)) -> dict[str, Any]:
    """Send the prompts under the regime (arrival times, then at most max_concurrency in
    flight, in order) and return summarize() of the run."""
    url = base_url.rstrip("/") + "/v1/completions"
    in_flight = asyncio.Semaphore(regime.max_concurrency or len(prompts))
    start = time.perf_counter()

    async def arrive(prompt: Prompt, at: float) -> RequestResult:
        await asyncio.sleep(start + at - time.perf_counter())
        async with in_flight:
            return await send_request(client, url, model, prompt)

    arrivals = arrival_times(len(prompts), regime.request_rate, seed)
    results = await asyncio.gather(*(arrive(p, t) for p, t in zip(prompts, arrivals)))
    return summarize(results, time.perf_counter() - start, percentiles)


# ------------------------------------------------------------------------------ metrics


def summarize(results: list[RequestResult], duration: float, percentiles: tuple[float, ...]) -> dict[str, Any]:
    """vLLM's calculate_metrics: counts and throughputs over the run's wall time, and per
    metric mean / median / std / percentiles in ms (0 where there are no values)."""
    ok = [r for r in results if r.error is None]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    edges = sorted([(r.start, 1) for r in ok] + [(r.token_times[-1], -1) for r in ok])  # ends first on ties
    metrics: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_output_tokens_per_s": peak_tokens_per_second(ok),
        "max_concurrent_requests": max(itertools.accumulate(d for _, d in edges), default=0),
    }
    samples = {"ttft": [r.ttft for r in ok],
               "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
               "itl": [gap for r in ok for gap in r.itl],
               "e2el": [r.latency for r in ok]}
    for name, values in samples.items():
        ms = np.array(values or [0.0]) * 1000
        metrics |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                    f"std_{name}_ms": float(ms.std())}
        metrics |= {f"p{p:g}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles}
    metrics["errors"] = [r.error for r in results if r.error is not None][:10]
    return metrics


def peak_tokens_per_second(ok: list[RequestResult]) -> float:
    """The most token events in one whole second after the first send (vLLM's buckets)."""
    if not ok:
        return 0.0
    first = min(r.start for r in ok)
    return float(np.bincount([int(t - first) for r in ok for t in r.token_times]).max())


TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
          "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def print_table(metrics: dict[str, Any], regime: Regime, percentiles: tuple[float, ...]) -> None:
    """The result block in `vllm bench serve`'s layout."""
    def row(label: str, value: Any) -> None:
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")

    for i, error in enumerate(metrics["errors"]):
        print(f"Error {i}: {error}")
    print(" Serving Benchmark Result ".center(50, "="))
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if regime.max_concurrency is not None:
        row("Maximum request concurrency:", regime.max_concurrency)
    if not math.isinf(regime.request_rate):
        row("Request rate configured (RPS):", float(regime.request_rate))
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"])
    row("Peak concurrent requests:", float(metrics["max_concurrent_requests"]))
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    for name, (short, title) in TITLES.items():
        print(title.center(50, "-"))
        row(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", metrics[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", metrics[f"p{p:g}_{name}_ms"])
    print("=" * 50, flush=True)


# --------------------------------------------------------------------------------- main


def describe(regime: Regime) -> str:
    """The regime as vllm bench serve's flags."""
    flags = [f"--max-concurrency {regime.max_concurrency}"] if regime.max_concurrency else []
    if not flags or not math.isinf(regime.request_rate):
        flags.append(f"--request-rate {regime.request_rate:g}")
    return " ".join(flags + [f"--num-prompts {regime.num_prompts}"])


def append_json(path: str, args: argparse.Namespace, env: dict[str, Any], regime: Regime,
                metrics: dict[str, Any]) -> None:
    """One JSON line: the environment, the arguments, the regime and every figure."""
    def plain(value: Any) -> Any:
        return "inf" if value == math.inf else value

    line = {"workload": "W4", "backend": args.label, **env, "args": {k: plain(v) for k, v in vars(args).items()},
            "num_prompts": regime.num_prompts, "max_concurrency": regime.max_concurrency,
            "request_rate": plain(regime.request_rate), **metrics}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


SUMMARY_HEADER = ("| regime | req/s | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
                  "| ITL p50 / p99 (ms) | failed |\n|---|---|---|---|---|---|---|\n")


def summary_row(regime: Regime, metrics: dict[str, Any]) -> str:
    """The regime's row of BENCH.md's W4 table (nan where p50 / p99 were not asked for)."""
    def p50_p99(name: str) -> str:
        return " / ".join(f"{metrics.get(f'p{p}_{name}_ms', math.nan):.2f}" for p in (50, 99))

    return (f"| `{describe(regime)}` | {metrics['request_throughput']:.2f} | {metrics['output_throughput']:,.0f} | "
            f"{p50_p99('ttft')} | {p50_p99('tpot')} | {p50_p99('itl')} | {metrics['failed']} |")


async def benchmark(args: argparse.Namespace, regimes: list[Regime], num_warmups: int) -> None:
    """Each regime in turn on its own prompts (as separate `vllm bench serve` calls would draw
    them); the warm-ups repeat the first regime's first prompt before it, under its limit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    env = environment()
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    rows = []
    async with make_client() as client:
        for i, regime in enumerate(regimes):
            prompts = random_prompts(tokenizer, regime.num_prompts, args.random_input_len,
                                     args.random_output_len, args.random_range_ratio, args.seed)
            if i == 0 and num_warmups:
                warm = await run_regime(client, args.base_url, args.model, prompts[:1] * num_warmups,
                                        Regime(num_warmups, regime.max_concurrency, math.inf))
                if warm["failed"]:
                    raise SystemExit(f"warm-up failed: {warm['errors'][0]}")
            print(f"== W4 [{args.label}] {describe(regime)}", flush=True)
            gc.collect()
            gc.freeze()  # as vLLM's client: no collector pauses over the long-lived objects
            metrics = await run_regime(client, args.base_url, args.model, prompts, regime, args.seed, percentiles)
            print_table(metrics, regime, percentiles)
            if args.json_out:
                append_json(args.json_out, args, env, regime, metrics)
            rows.append(summary_row(regime, metrics))
    print(SUMMARY_HEADER + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (draws the prompts)")
    parser.add_argument("--label", default="server", help="what serves (minivllm, vllm); goes to the JSON line")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)")
    parser.add_argument("--num-warmups", type=int, default=None,
                        help=f"warm-up requests before the (first) regime; default 0, {W4_WARMUPS} with --w4")
    parser.add_argument("--metric-percentiles", default="50,90,99")
    parser.add_argument("--w4", action="store_true",
                        help="BENCH.md's three W4 regimes in turn (replaces --num-prompts/--max-concurrency/--request-rate)")
    parser.add_argument("--json-out", default=None, help="append one JSON line per regime to this file")
    args = parser.parse_args()

    regimes = list(W4_REGIMES) if args.w4 else [Regime(args.num_prompts, args.max_concurrency, args.request_rate)]
    num_warmups = args.num_warmups if args.num_warmups is not None else (W4_WARMUPS if args.w4 else 0)
    asyncio.run(benchmark(args, regimes, num_warmups))


if __name__ == "__main__":
    main()
