"""Where a decode step's time goes: host time, GPU kernel time, and the top kernels.

Fills the engine with --batch requests (random prompts of --context tokens), lets them
reach steady decoding, then times --steps engine steps: wall time per step, host time
per step (engine.step minus the wait for the device), and the CUDA kernel time per step
from torch.profiler.

    python -m benchmarks.kernels.step_profile --model qwen3-0.6b --batch 256 --context 1000
    python -m benchmarks.kernels.step_profile --batch 256 --shared-prefix 2048 --context 64   # W3's decode
    python -m benchmarks.kernels.step_profile --prefill --context 1024     # W2's time to first token
    python -m benchmarks.kernels.step_profile --start w1                   # W1's prompt steps
    python -m benchmarks.kernels.step_profile --start w3                   # W3's prompt steps
    python -m benchmarks.kernels.step_profile --batch 1 --temperature 0 --no-pdl   # W2's kernels, one by one

--prefill times whole generate() calls of one fresh --context-token prompt and one output
token instead: wall time per call against the GPU kernel time per call (the gap is host
work: the eager forward's launches, scheduling, sampling, output).
--start w1 / w3 times a workload's first steps instead: its 256 requests added at once, every
step until the last prompt token is computed (prompt chunks of max_num_batched_tokens, with the
decodes of the prompts done so far). Each run gets prompts of its own, so nothing comes from an
earlier run's cache (W3's requests still share their prefix within the run, as in the benchmark).
"""

import argparse
import cProfile
import pstats
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    W1_TEMPERATURE,
    Request,
    add_common_args,
    make_llm,
    random_prompt,
    resolve_model,
    synchronize,
    w1_requests,
    warmup_llm,
)
from benchmarks.prefix_cache import w3_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every prompt starts with (before its own --context tokens)")
    parser.add_argument("--cprofile", action="store_true", help="also print the host's top functions")
    parser.add_argument("--prefill", action="store_true", help="profile single-prompt prefills (TTFT)")
    parser.add_argument("--start", choices=("w1", "w3"),
                        help="profile this workload's steps until every prompt is computed")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch our kernels without programmatic dependent launch: under PDL a kernel's "
                             "profiled time includes its wait for the kernel before it, so per-kernel times "
                             "only add up without it")
    args = parser.parse_args()
    if args.no_pdl:
        from minivllm.kernels import pdl

        pdl.pdl_enabled = lambda device: False
    spec = resolve_model(args.model)
    llm, _ = make_llm(args, spec, max_num_seqs=max(args.batch, 1))
    if args.prefill:
        profile_prefill(llm, args, spec.vocab_size)
    elif args.start:
        profile_start(llm, args, spec.vocab_size)
    else:
        profile_decode(llm, args, spec.vocab_size)


def host_profile(run: Callable[[], None], args: argparse.Namespace) -> None:
    """With --cprofile: the host's top functions over `run`."""
    if args.cprofile:
        with cProfile.Profile() as profile:
            run()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


def gpu_profile(run: Callable[[], None], calls: int) -> str:
    """GPU kernel time per call over `run` (which makes `calls` calls) and the top kernels."""
    # (On a machine without CUDA, for smoke runs: CPU events, and 0 ms of kernels.)
    activities = torch.profiler.ProfilerActivity
    activity = activities.CUDA if torch.cuda.is_available() else activities.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        run()
    events = prof.key_averages()
    gpu_us = sum(e.device_time_total for e in events) / calls
    return f"{gpu_us / 1e3:.3f} ms", events.table(sort_by="device_time_total", row_limit=12, max_name_column_width=60)


def profile_and_report(run: Callable[[], None], calls: int, args: argparse.Namespace,
                       describe: Callable[[float, str], str]) -> None:
    """run() once to warm up, once timed, once under the profiler; print describe(wall
    seconds of the timed run, GPU kernel time per call), the top kernels, the host profile."""
    run()
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    gpu, table = gpu_profile(run, calls)
    print(describe(wall, gpu))
    print(table)
    host_profile(run, args)


def profile_prefill(llm: Any, args: argparse.Namespace, vocab_size: int) -> None:
    from minivllm import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def run() -> None:  # fresh prompts: nothing comes from the prefix cache
        for _ in range(args.steps):
            llm.generate({"prompt_token_ids": random_prompt(rng, args.context, vocab_size)}, params, use_tqdm=False)
        synchronize()

    profile_and_report(run, args.steps, args, lambda wall, gpu: (
        f"== prefill profile: one {args.context}-token prompt, 1 output token\n"
        f"wall per generate() {wall / args.steps * 1e3:.3f} ms | GPU kernels per generate() {gpu}"))


def start_requests(workload: str, scale: float, vocab_size: int, run: int) -> list[Request]:
    """Run `run`'s requests of W1 or W3, none found in an earlier run's prefix cache: W1's
    prompts get a first token of the run's own, W3 draws the run's own prefix."""
    if workload == "w3":
        return w3_requests(scale, vocab_size, seed=run)
    return [Request([(r.prompt_token_ids[0] + run) % vocab_size] + r.prompt_token_ids[1:], r.max_tokens)
            for r in w1_requests(scale=scale, vocab_size=vocab_size)]


def profile_start(llm: Any, args: argparse.Namespace, vocab_size: int) -> None:
    from minivllm import SamplingParams

    engine = llm.llm_engine
    warmup_llm(llm, vocab_size)
    steps = runs = 0
    # Every run's prompts (profile_and_report's warm-up, timed, profiled and --cprofile runs),
    # drawn before any timing: drawing W3's 540,000 random tokens takes ~40 ms.
    num_runs = 4 if args.cprofile else 3
    run_requests = [start_requests(args.start, args.scale, vocab_size, run) for run in range(1, num_runs + 1)]

    def run() -> None:
        nonlocal steps, runs
        runs += 1
        for i, request in enumerate(run_requests[runs - 1]):
            params = SamplingParams(temperature=W1_TEMPERATURE, ignore_eos=True, max_tokens=request.max_tokens)
            engine.add_request(f"{args.start}-{runs}-{i}", {"prompt_token_ids": request.prompt_token_ids}, params)
        steps = 0
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
            engine.step()
            steps += 1
        synchronize()
        for request_id in list(engine.requests):
            engine.abort_request(request_id)

    profile_and_report(run, 1, args, lambda wall, gpu: (
        f"== {args.start.upper()}'s first {steps} steps (until every prompt is computed)\n"
        f"wall {wall * 1e3:.1f} ms ({wall * 1e3 / steps:.2f} ms per step) | GPU kernels {gpu}"))


def profile_decode(llm: Any, args: argparse.Namespace, vocab_size: int) -> None:
    from minivllm import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    prefix = random_prompt(rng, args.shared_prefix, vocab_size) if args.shared_prefix else []
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=10 * args.steps + 100)
    for i in range(args.batch):
        engine.add_request(f"p{i}", {"prompt_token_ids": prefix + random_prompt(rng, args.context, vocab_size)}, params)
    while engine.scheduler.waiting or any(s.num_output_tokens < 2 for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    runner = engine.model_runner
    waited = 0.0
    collect = runner.collect

    def timed_collect(handle: Any) -> Any:  # a StepHandle; collect's result
        nonlocal waited
        start = time.perf_counter()
        if handle.done is not None:
            handle.done.synchronize()
        waited += time.perf_counter() - start
        return collect(handle)

    runner.collect = timed_collect
    synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    synchronize()
    wall = (time.perf_counter() - start) / args.steps
    host = wall - waited / args.steps

    def run() -> None:
        for _ in range(args.steps):
            engine.step()
        synchronize()

    gpu, table = gpu_profile(run, args.steps)
    print(f"== step profile: batch {args.batch}, context ~{args.context}, shared prefix {args.shared_prefix}")
    print(f"wall per step {wall * 1e3:.3f} ms | host per step (not waiting) {host * 1e3:.3f} ms | "
          f"GPU kernels per step {gpu}")
    print(table)
    host_profile(run, args)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)


if __name__ == "__main__":
    main()
