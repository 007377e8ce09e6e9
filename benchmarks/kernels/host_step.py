"""The engine's host work per step, on the CPU machine (no GPU needed).

W3's requests (256 sequences, a 2,048-token shared prefix, 64 own tokens, 128 outputs; --scale
shrinks them) run through a tiny random model whose attention is stubbed out, so that what
costs time is the Python around each step: scheduling, the step's input rows, the sampling
metadata, reading tokens back and finishing requests. On the accelerator that work overlaps
the device's step, and it sets the pace wherever it is the longer of the two (W3's cascade
decode steps, serving many short requests).

    python -m benchmarks.kernels.host_step [--scale 1.0] [--runs 3]

Prints each component's median per call and total over the fastest run, and "host": a step's
wall time less the model's forward pass and the sampler's (device work on the accelerator).
The machine's own noise is large: compare changes over several runs.
"""

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import W1_TEMPERATURE, timed_generate
from benchmarks.prefix_cache import w3_requests

TIMED: dict[str, list[float]] = defaultdict(list)


def timed(owner: Any, name: str, record: Callable[[float], None]) -> None:
    """Pass the wall time of every call of owner.name (a class's method, a module's function)
    to record, in seconds."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="W3's sizes times this")
    parser.add_argument("--runs", type=int, default=3, help="timed runs (the fastest is reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from minivllm import LLM
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.scheduler import Scheduler
    from minivllm.executor.model_runner import ModelRunner
    from minivllm.layers.attention import Attention
    from minivllm.layers.sampler import Sampler
    from minivllm.local_models import build_tiny_model

    Attention.forward = lambda self, positions, q, k, v, meta: q.clone()  # the device's work, not the host's
    for owner, name, label in [(LLMEngine, "step", "step"), (Scheduler, "schedule", "schedule"),
                               (ModelRunner, "prepare_inputs", "prepare_inputs"),
                               (ModelRunner, "_sampling_metadata", "sampling_metadata"),
                               (ModelRunner, "execute_model", "execute_model (upload + forward)"),
                               (ModelRunner, "_upload", "upload"), (Sampler, "forward", "sampler"),
                               (LLMEngine, "_finish_step", "finish_step"),
                               (ModelRunner, "launch_forward", "launch_forward"),
                               (ModelRunner, "launch_sampling", "launch_sampling")]:
        timed(owner, name, lambda seconds, label=label: TIMED[label].append(seconds))  # (TIMED is cleared per run)

    with tempfile.TemporaryDirectory() as model_dir:
        build_tiny_model(model_dir, max_position_embeddings=4096)
        llm = LLM(model_dir, dtype="float32", max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=8192, enable_prefix_caching=True)
        vocab_size = llm.llm_engine.config.hf_config.vocab_size
        timed_generate(llm, w3_requests(args.scale, vocab_size, seed=99)[:8], W1_TEMPERATURE)  # warm-up
        runs = []
        for seed in range(args.runs):
            TIMED.clear()
            elapsed = timed_generate(llm, w3_requests(args.scale, vocab_size, seed), W1_TEMPERATURE)["elapsed_s"]
            runs.append((elapsed, dict(TIMED)))
    elapsed, times = min(runs, key=lambda run: run[0])
    steps = len(times["step"])
    print(f"W3 x {args.scale} on CPU, attention stubbed: {steps} steps, fastest run {elapsed:.3f} s "
          f"(runs: {', '.join(f'{run[0]:.3f}' for run in runs)})")
    for label, values in times.items():
        print(f"  {label:34s} {len(values):5d} calls  median {statistics.median(values) * 1e3:7.3f} ms"
              f"  total {sum(values) * 1e3:8.1f} ms")
    device_work = sum(times["execute_model (upload + forward)"]) - sum(times["upload"]) + sum(times["sampler"])
    host = sum(times["step"]) - device_work
    print(f"  host: {host * 1e3:.1f} ms in all, {host / steps * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
