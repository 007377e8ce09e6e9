"""W2 — single-stream latency (benchmarks/README.md): one request, 1,024-token prompt, 256 output
tokens, greedy, ignore_eos.

    python -m benchmarks.latency --model qwen3-0.6b [--runs 5]

TTFT is the wall time of generate() with max_tokens=1; TPOT is (time for all output
tokens - TTFT) / (output tokens - 1). Every call gets a fresh random prompt, so the
prefix cache never helps; the best of --runs is reported, medians alongside.
"""

from __future__ import annotations

import argparse
import random
import statistics

from benchmarks.common import (
    Request,
    add_common_args,
    make_llm,
    random_prompt,
    report,
    resolve_model,
    scaled,
    shutdown_llm,
    startup_metrics,
    timed_generate,
)

W2_PROMPT_LEN = 1024
W2_OUTPUT_LEN = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    spec = resolve_model(args.model, args.load_format)
    prompt_len = scaled(W2_PROMPT_LEN, args.scale)
    output_len = max(2, scaled(W2_OUTPUT_LEN, args.scale))
    rng = random.Random(0)
    llm, startup_s = make_llm(args, spec)
    startup = startup_metrics(llm, startup_s)

    def seconds_for(max_tokens: int) -> float:
        request = Request(random_prompt(rng, prompt_len, spec.vocab_size), max_tokens)
        run = timed_generate(llm, [request], temperature=0.0)
        assert run["output_tokens"] == max_tokens, f"asked for {max_tokens} tokens, got {run['output_tokens']}"
        return run["elapsed_s"]

    for max_tokens in (1, output_len):  # warm-up: both shapes once, untimed
        seconds_for(max_tokens)
    ttfts, fulls = zip(*[(seconds_for(1), seconds_for(output_len)) for _ in range(args.runs)])
    shutdown_llm(llm)

    def tpot(full: float, ttft: float) -> float:
        return (full - ttft) / (output_len - 1)

    best_tpot = tpot(min(fulls), min(ttfts))
    report("W2", "minivllm", args, {
        "prompt_len": prompt_len, "output_len": output_len, "runs": args.runs,
        "ttft_ms": 1e3 * min(ttfts), "tpot_ms": 1e3 * best_tpot,
        "ttft_ms_median": 1e3 * statistics.median(ttfts),
        "tpot_ms_median": 1e3 * tpot(statistics.median(fulls), statistics.median(ttfts)),
        "e2e_ms": 1e3 * min(fulls), "decode_tok_s": 1 / best_tpot} | startup)


if __name__ == "__main__":
    main()
