"""W4 and W6 — online serving: load an OpenAI-compatible server as `vllm bench serve` does.

    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --model m --tokenizer DIR \\
        --max-concurrency 64 --num-prompts 640 --num-warmups 16
    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --model m --tokenizer DIR --w4
    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --model m --tokenizer DIR --w6 [--distinct-schemas]

For machines without vLLM; the server is minivllm's (`python -m minivllm serve MODEL_DIR
--served-model-name m ...`) or vLLM's. The prompts are vLLM's random dataset, drawn as vLLM
0.20 draws it (the same texts for the same seed and tokenizer), sent as text to
/v1/completions (ignore_eos, temperature 0, streamed with usage). The figures are vLLM's:
TTFT = first token event - send; ITL = gaps between token events, pooled; E2EL = last token
event - send; TPOT = (E2EL - TTFT) / (output tokens - 1) for requests with more than one;
token counts from the server's usage chunk; throughputs over the wall time of the whole run.

--w6 sends W6's requests instead (benchmarks/README.md): prompts drawn as W4's but with seed 1
(2 with --distinct-schemas), each carrying W6's JSON schema as response_format (its own copy,
renamed, with --distinct-schemas), sampled at temperature 1 and ending where the object closes
(max_tokens W6_MAX_TOKENS, no ignore_eos). Every reply is checked to be one JSON document valid
under its request's schema; the share that is counts with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import numpy as np

from benchmarks.common import environment
from benchmarks.schemas import W6_MAX_TOKENS, reply_error, response_format


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_len: int  # tokens, by the client's tokenizer (the server's usage count replaces it)
    output_len: int  # max_tokens
    response_format: dict[str, Any] | None = None  # W6's: a JSON schema


@dataclass(frozen=True)
class Regime:
    num_prompts: int
    max_concurrency: int | None  # None: no limit
    request_rate: float  # Poisson arrivals per second; inf: all at once


# W4's three regimes (benchmarks/README.md), as vLLM's staged .vl/tools/vllm_w4.sh runs them.
W4_REGIMES = (Regime(64, 1, math.inf), Regime(640, 64, math.inf), Regime(1000, None, math.inf))
W4_WARMUPS = 16
# W6's: W4's last two. Their own prompt seeds, so that W4 and both W6 variants can run one
# after the other on one server without one's prompts hitting the prefix cache of another's.
W6_REGIMES = W4_REGIMES[1:]
W6_SEED, W6_DISTINCT_SEED = 1, 2


@dataclass
class RequestResult:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    start: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)  # arrivals of the token events
    output_tokens: int = 0
    error: str | None = None
    text: list[str] = field(default_factory=list)  # the reply's pieces, kept for W6's requests
    finish_reason: str | None = None  # kept for W6's requests


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
    """Text whose re-encoding has `target` tokens if 10 rounds of decode, re-encode and cut
    or pad with random ids get there (vLLM's gen_prompt_decode_to_target_len)."""
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

POOL_SIZE = 32  # requests in flight per httpx client: its pool scans all its connections per request


@contextlib.asynccontextmanager
async def open_clients(max_in_flight: int) -> AsyncIterator[list[httpx.AsyncClient]]:
    """httpx clients for max_in_flight requests, POOL_SIZE each (with 1000 connections in one
    pool the scans cost more CPU than the streams); no timeout, $OPENAI_API_KEY as bearer
    token if set, and one TLS context for all (each would load the CA bundle: 30 ms)."""
    key = os.environ.get("OPENAI_API_KEY")
    options: dict[str, Any] = {"timeout": None, "verify": httpx.create_ssl_context(),
                               "headers": {"Authorization": f"Bearer {key}"} if key else None,
                               "limits": httpx.Limits(max_connections=None, max_keepalive_connections=None)}
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(httpx.AsyncClient(**options))
               for _ in range(math.ceil(max_in_flight / POOL_SIZE))]


async def sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """The payloads of the stream's `data:` lines, line by line (as bytes: aiter_lines' text
    layers cost as much as the JSON parsing); blank separators and `:` comments skipped."""
    rest = b""
    async for chunk in response.aiter_bytes():
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()


def request_body(model: str, prompt: Prompt) -> dict[str, Any]:
    """A streamed completion with usage: W4's (greedy, ignore_eos) or, for a prompt with a
    response_format, W6's (temperature 1, ending where the object closes)."""
    body = {"model": model, "prompt": prompt.text, "max_tokens": prompt.output_len,
            "stream": True, "stream_options": {"include_usage": True}}
    if prompt.response_format is None:
        return body | {"temperature": 0.0, "ignore_eos": True}
    return body | {"temperature": 1.0, "response_format": prompt.response_format}


async def send_request(client: httpx.AsyncClient, url: str, model: str, prompt: Prompt) -> RequestResult:
    """One streamed completion: when each token event arrives (any event with a choice, its
    text possibly empty, as vLLM counts them) and the usage chunk's counts; for W6's requests
    the text and finish reason too."""
    keep_text = prompt.response_format is not None
    result = RequestResult(start=time.perf_counter(), prompt_tokens=prompt.prompt_len)
    try:
        async with client.stream("POST", url, json=request_body(model, prompt)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body}"
                return result
            async for data in sse_data(response):
                if data == b"[DONE]":  # the stream's last line
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {event['error']}"
                    return result
                if choices := event.get("choices"):
                    result.token_times.append(time.perf_counter())
                    if keep_text:
                        result.text.append(choices[0]["text"])
                        result.finish_reason = choices[0].get("finish_reason") or result.finish_reason
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


async def run_regime(clients: list[httpx.AsyncClient], base_url: str, model: str, prompts: list[Prompt],
                     regime: Regime, seed: int = 0,
                     percentiles: tuple[float, ...] = (50, 90, 99)) -> dict[str, Any]:
    """Send the prompts under the regime: each at its arrival time, then in order with at most
    max_concurrency in flight, request i on client i mod the number of clients the regime
    needs. Returns summarize() of the run, the share of it this process spent on the CPU and,
    for W6's prompts, check_replies()."""
    url = base_url.rstrip("/") + "/v1/completions"
    slots = regime.max_concurrency or len(prompts)
    in_flight = asyncio.Semaphore(slots)
    clients = clients[:math.ceil(slots / POOL_SIZE)]
    start, cpu_start = time.perf_counter(), time.process_time()

    async def arrive(i: int, prompt: Prompt, at: float) -> RequestResult:
        await asyncio.sleep(start + at - time.perf_counter())
        async with in_flight:
            return await send_request(clients[i % len(clients)], url, model, prompt)

    arrivals = arrival_times(len(prompts), regime.request_rate, seed)
    results = await asyncio.gather(*(arrive(i, p, t) for i, (p, t) in enumerate(zip(prompts, arrivals))))
    duration = time.perf_counter() - start
    cpu_busy = (time.process_time() - cpu_start) / duration
    metrics = summarize(results, duration, percentiles) | {"client_cpu_busy": cpu_busy}
    if any(p.response_format is not None for p in prompts):
        metrics |= check_replies(prompts, results)
    return metrics


def check_replies(prompts: list[Prompt], results: list[RequestResult]) -> dict[str, Any]:
    """W6: how many successful replies are one JSON document valid under their request's
    schema (a server that enforces the schemas gets them all), with the first reasons why not."""
    checked, problems = 0, []
    for prompt, result in zip(prompts, results):
        if result.error is not None or prompt.response_format is None:
            continue
        checked += 1
        problem = reply_error("".join(result.text), prompt.response_format["json_schema"]["schema"])
        if problem is not None:
            problems.append(f"{problem} (finish_reason {result.finish_reason})")
    return {"valid_replies": checked - len(problems), "invalid_replies": len(problems),
            "valid_fraction": (checked - len(problems)) / checked if checked else 0.0,
            "invalid_examples": problems[:5]}


# ------------------------------------------------------------------------------ metrics


def summarize(results: list[RequestResult], duration: float, percentiles: tuple[float, ...]) -> dict[str, Any]:
    """vLLM's calculate_metrics over the successful requests: counts, throughputs over the
    run's wall time, the peaks, and per metric mean / median / std / percentiles in ms
    (0 where there are no values), with the first 10 errors."""
    ok = [r for r in results if r.error is None]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    first_send = min((r.start for r in ok), default=0.0)
    per_second = np.bincount([int(t - first_send) for r in ok for t in r.token_times], minlength=1)
    edges = sorted([(r.start, 1) for r in ok] + [(r.token_times[-1], -1) for r in ok])  # ends first on ties
    metrics: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_output_tokens_per_s": float(per_second.max()),  # token events in a whole second
        "max_concurrent_requests": max(itertools.accumulate(step for _, step in edges), default=0),
    }
    samples = {"ttft": [r.token_times[0] - r.start for r in ok],
               "tpot": [(r.token_times[-1] - r.token_times[0]) / (r.output_tokens - 1)
                        for r in ok if r.output_tokens > 1],
               "itl": [gap for r in ok for gap in np.diff(r.token_times)],
               "e2el": [r.token_times[-1] - r.start for r in ok]}
    for name, values in samples.items():
        ms = np.array(values or [0.0]) * 1000
        metrics |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                    f"std_{name}_ms": float(ms.std())}
        metrics |= {f"p{p:g}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles}
    return metrics | {"errors": [r.error for r in results if r.error is not None][:10]}


TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
          "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def print_rows(rows: list[tuple[str, float | int]]) -> None:
    for label, value in rows:
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")


def print_table(metrics: dict[str, Any], regime: Regime, percentiles: tuple[float, ...]) -> None:
    """The first errors, then the result block in `vllm bench serve`'s layout."""
    for i, error in enumerate(metrics["errors"]):
        print(f"Error {i}: {error}")
    print(" Serving Benchmark Result ".center(50, "="))
    print_rows([("Successful requests:", metrics["completed"]), ("Failed requests:", metrics["failed"])]
               + ([("Maximum request concurrency:", regime.max_concurrency)] if regime.max_concurrency else [])
               + ([("Request rate configured (RPS):", regime.request_rate)] if math.isfinite(regime.request_rate)
                  else [])
               + [("Benchmark duration (s):", metrics["duration"]),
                  ("Total input tokens:", metrics["total_input_tokens"]),
                  ("Total generated tokens:", metrics["total_output_tokens"]),
                  ("Request throughput (req/s):", metrics["request_throughput"]),
                  ("Output token throughput (tok/s):", metrics["output_throughput"]),
                  ("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"]),
                  ("Peak concurrent requests:", float(metrics["max_concurrent_requests"])),
                  ("Total token throughput (tok/s):", metrics["total_token_throughput"])])
    if "valid_replies" in metrics:
        print("Structured output".center(50, "-"))
        for problem in metrics["invalid_examples"]:
            print(f"Invalid: {problem}")
        print_rows([("Valid JSON replies:", metrics["valid_replies"]),
                    ("Invalid JSON replies:", metrics["invalid_replies"]),
                    ("Mean output tokens per request:",
                     metrics["total_output_tokens"] / max(1, metrics["completed"]))])
    for name, (short, title) in TITLES.items():
        print(title.center(50, "-"))
        print_rows([(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"]),
                    (f"Median {short} (ms):", metrics[f"median_{name}_ms"])]
                   + [(f"P{p:g} {short} (ms):", metrics[f"p{p:g}_{name}_ms"]) for p in percentiles])
    print("=" * 50)
    if metrics["client_cpu_busy"] > 0.7:
        print(f"note: this client was on the CPU {metrics['client_cpu_busy']:.0%} of the run; "
              "its own delays are likely part of TTFT and ITL")


# --------------------------------------------------------------------------------- main


def append_json(path: str, workload: str, args: argparse.Namespace, env: dict[str, Any], regime: Regime,
                metrics: dict[str, Any]) -> None:
    """One JSON line: the environment, the arguments, the regime and every figure
    (an infinite rate as "inf", as vLLM writes it)."""
    def plain(value: Any) -> Any:
        return "inf" if value == math.inf else value

    line = {"workload": workload, "backend": args.label, **env, "args": {k: plain(v) for k, v in vars(args).items()},
            "num_prompts": regime.num_prompts, "max_concurrency": regime.max_concurrency,
            "request_rate": plain(regime.request_rate), **metrics}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


async def benchmark(args: argparse.Namespace, regimes: list[Regime], num_warmups: int) -> None:
    """Each regime in turn on its own prompts (as separate `vllm bench serve` calls draw
    them); the warm-ups repeat the first regime's first prompt before it, under its limit.
    With --w6 every request carries W6's schema: index 0 (the one fixed schema) or, with
    --distinct-schemas, the next index of this run, warm-ups included (no two alike); a failed
    request or an invalid reply makes the exit status 1, once every regime has run."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    env = environment()
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    workload = ("W6-distinct" if args.distinct_schemas else "W6") if args.w6 else "W4"
    schema_indices = itertools.count(1) if args.distinct_schemas else itertools.repeat(0)

    def shaped(prompts: list[Prompt]) -> list[Prompt]:
        if not args.w6:
            return prompts
        return [replace(p, output_len=W6_MAX_TOKENS, response_format=response_format(next(schema_indices)))
                for p in prompts]

    faults = 0
    async with open_clients(max(r.max_concurrency or r.num_prompts for r in regimes)) as clients:
        for i, regime in enumerate(regimes):
            prompts = random_prompts(tokenizer, regime.num_prompts, args.random_input_len,
                                     args.random_output_len, args.random_range_ratio, args.seed)
            if i == 0 and num_warmups:
                warm = await run_regime(clients, args.base_url, args.model, shaped(prompts[:1] * num_warmups),
                                        Regime(num_warmups, regime.max_concurrency, math.inf))
                if warm["failed"]:
                    raise SystemExit(f"warm-up failed: {warm['errors'][0]}")
            prompts = shaped(prompts)
            print(f"== {workload} [{args.label}] {regime}", flush=True)
            gc.collect()
            gc.freeze()  # as vLLM's client: no collector passes over the long-lived objects
            metrics = await run_regime(clients, args.base_url, args.model, prompts, regime, args.seed, percentiles)
            print_table(metrics, regime, percentiles)
            if args.json_out:
                append_json(args.json_out, workload, args, env, regime, metrics)
            if args.w6:
                faults += metrics["failed"] + metrics["invalid_replies"]
    if faults:
        raise SystemExit(f"{workload}: {faults} requests failed or replied outside their schema")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (draws the prompts)")
    parser.add_argument("--label", default="server", help="what serves (minivllm, vllm): the JSON line's backend")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None,
                        help=f"draws the prompts (default 0; with --w6 {W6_SEED}, {W6_DISTINCT_SEED} with "
                             "--distinct-schemas)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: any)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--num-warmups", type=int, default=None,
                        help=f"warm-up requests before the (first) regime; default 0, {W4_WARMUPS} with --w4 or --w6")
    parser.add_argument("--metric-percentiles", default="50,90,99")
    parser.add_argument("--w4", action="store_true",
                        help="W4's three regimes in turn, instead of --num-prompts, --max-concurrency "
                             "and --request-rate")
    parser.add_argument("--w6", action="store_true",
                        help="W6: W4's last two regimes, every request with W6's JSON schema as response_format, "
                             "every reply checked against it")
    parser.add_argument("--distinct-schemas", action="store_true",
                        help="with --w6: each request its own schema (renamed fields: no grammar cache hits)")
    parser.add_argument("--json-out", default=None, help="append one JSON line per regime to this file")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.w4 and args.w6:
        parser.error("--w4 and --w6 are different workloads: give one")
    if args.distinct_schemas and not args.w6:
        parser.error("--distinct-schemas needs --w6")
    if args.seed is None:
        args.seed = (W6_DISTINCT_SEED if args.distinct_schemas else W6_SEED) if args.w6 else 0
    if args.w4 or args.w6:
        regimes = list(W4_REGIMES if args.w4 else W6_REGIMES)
    else:
        regimes = [Regime(args.num_prompts, args.max_concurrency, args.request_rate)]
    num_warmups = args.num_warmups if args.num_warmups is not None else (W4_WARMUPS if args.w4 or args.w6 else 0)
    asyncio.run(benchmark(args, regimes, num_warmups))


if __name__ == "__main__":
    main()
