"""The host's time per step at batch 1 with and without speculative decoding, on the CPU machine
(no GPU needed): W7's shape (one request, greedy, ngram or suffix drafts of 4 tokens) on a tiny
random model whose 16-token vocabulary makes its output loop, so drafts are found and often right.

A step that verifies drafts is synchronous: the engine reads it back, then proposes, schedules,
prepares and launches the next one, all while the device waits. "readback->launch" is that
host path: from the start of the readback to the model's forward pass. The other rows split a
step's host work (the model's forward pass left out of all of them; the sampler's torch ops on a
16-token vocabulary stand for their launches). Without speculation steps overlap, so "step" is
the figure that matters there.

    python -m benchmarks.kernels.spec_step [--repeats 5] [--stream] [--stop]

Medians per step over the steady steps (synchronous ones with speculation, the overlapped decodes
without), in microseconds of this thread's CPU time (other processes' load does not count; their
use of the caches still does): compare changes over several runs.
"""

import argparse
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

VOCAB_SIZE = 16
CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}
_step: dict[str, float] = defaultdict(float)  # this step's time per label
_excluded = [0.0]  # the model's forward passes so far (not host work)
_readback_start: list[float] = []  # when this step's readback began, while it has not launched


def timed(owner: type, name: str, label: str) -> None:
    """Add each call's time, less the forward passes inside it, to this step's label."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        excluded, start = _excluded[0], time.thread_time()
        if label == "collect":
            _readback_start[:] = [start]
        try:
            return original(*args, **kwargs)
        finally:
            _step[label] += time.thread_time() - start - (_excluded[0] - excluded)

    setattr(owner, name, wrapper)


def exclude_forward(model: torch.nn.Module) -> None:
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        if _readback_start:
            _step["readback->launch"] += start - _readback_start.pop()
        try:
            return original(*args, **kwargs)
        finally:
            _excluded[0] += time.thread_time() - start

    model.forward = forward  # type: ignore[method-assign]


def run(model_dir: str, spec: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, float]:
    from minivllm import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", max_model_len=1024, block_size=16, speculative_config=spec)
    engine = llm.llm_engine
    exclude_forward(engine.model_runner.model)
    prompt = [random.Random(0).randrange(3, VOCAB_SIZE) for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            stop=["never in the output"] if args.stop else None)
    steps: list[dict[str, float]] = []
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        engine.add_request(str(repeat), {"prompt_token_ids": prompt}, params, stream=args.stream)
        while engine.has_unfinished_requests():
            _step.clear()
            engine.step()
            _readback_start.clear()
            if repeat:
                steps.append(dict(_step))
    llm.shutdown()
    # Steady steps: launched after their readback with speculation, before it without.
    steady = [step for step in steps if "collect" in step and "launch_forward" in step
              and ("readback->launch" in step) == (spec is not None)]
    labels = dict.fromkeys(label for step in steady for label in step)
    return {label: statistics.median(step.get(label, 0.0) for step in steady) * 1e6 for label in labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="requests timed, one after the other")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stream", action="store_true", help="stream outputs (text every step)")
    parser.add_argument("--stop", action="store_true", help="with a stop string (checked every token)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.scheduler import Scheduler
    from minivllm.executor.model_runner import ModelRunner
    from minivllm.layers.sampler import Sampler
    from minivllm.local_models import build_tiny_model

    for owner, name, label in [
            (LLMEngine, "step", "step"), (ModelRunner, "collect", "collect"), (LLMEngine, "_check_stop", "stop checks"),
            (Scheduler, "propose", "propose"), (Scheduler, "schedule", "schedule"),
            (ModelRunner, "prepare_forward", "prepare_forward"), (ModelRunner, "launch_forward", "launch_forward"),
            (ModelRunner, "_upload", "  upload"), (ModelRunner, "launch_sampling", "launch_sampling"),
            (ModelRunner, "_sampling_metadata", "  sampling metadata"), (Sampler, "forward", "  sampler ops"),
            (LLMEngine, "_outputs", "outputs")]:
        timed(owner, name, label)
    with tempfile.TemporaryDirectory() as model_dir:
        build_tiny_model(model_dir, vocab_size=VOCAB_SIZE)
        results = {name: run(model_dir, spec, args) for name, spec in CONFIGS.items()}
    labels = dict.fromkeys(label for result in results.values() for label in result)
    print(f"host us per step (median){'':4s}" + "".join(f"{name:>10s}" for name in results))
    for label in labels:
        print(f"{label:28s}" + "".join(f"{result.get(label, 0.0):10.1f}" for result in results.values()))


if __name__ == "__main__":
    main()
