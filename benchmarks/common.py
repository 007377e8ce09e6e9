"""Shared pieces of the benchmark scripts: model resolution, workloads, timing, results.

Workloads are defined in benchmarks/README.md. Every script
accepts `--scale` to shrink a workload for CPU smoke runs; numbers at a scale other
than 1 are not comparable with anything and say so in their JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from benchmarks.schemas import leading_object_counts

REPO_ROOT = Path(__file__).resolve().parents[1]

# W1 as benchmarks/README.md defines it, and the totals it must produce at full size.
W1_NUM_PROMPTS = 256
W1_PROMPT_LEN = (100, 1024)
W1_OUTPUT_LEN = (100, 1024)
W1_TOKEN_ID_MAX = 10000
W1_OUTPUT_TOKENS = 133_966
W1_PROMPT_TOKENS = 142_827
W1_TEMPERATURE = 0.6
DEFAULT_MAX_MODEL_LEN = 4096  # W1's max_model_len (benchmarks/README.md); W2 and W3 fit in it too


# ----------------------------------------------------------------------------- kernel microbenchmarks

def kernel_benchmark_args(doc: str, sweep_help: str,
                          add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
                          ) -> tuple[argparse.Namespace, float]:
    """A kernel microbenchmark's start: its command line (--sweep, and what add_arguments adds),
    a GPU check, a fixed seed and the banner line. Returns the arguments and copy_bandwidth()."""
    import triton

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help=sweep_help)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(sys.argv[0]).name} needs a CUDA GPU")
    torch.manual_seed(0)
    peak = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"device copy (read + write) {peak / 1e9:.0f} GB/s", flush=True)
    return args, peak


def copy_bandwidth() -> float:
    """Bytes per second (read + write) of a 1 GiB device-to-device copy: the practical peak
    that memory-bound kernels are compared with."""
    import triton.testing

    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A model directory ready for LLM(...) or transformers, and how to load its weights."""

    path: str
    load_format: str  # "auto" (weights from the directory) or "dummy" (random weights)
    vocab_size: int
    max_position_embeddings: int


def _preset_dir(name: str) -> Path:
    return Path(tempfile.gettempdir()) / "minivllm-bench-presets" / name


def resolve_model(model: str, load_format: str = "auto") -> ModelSpec:
    """A directory is used as is; a preset name (benchmarks/presets.py) becomes a config-only
    directory (config.json + demo tokenizer) run with random weights."""
    if os.path.isdir(model):
        path = model
    else:
        from benchmarks.presets import PRESETS, write_preset

        if model not in PRESETS:
            raise SystemExit(f"--model {model!r} is neither a directory nor a preset "
                             f"(presets: {', '.join(sorted(PRESETS))}).")
        path = str(write_preset(model, str(_preset_dir(model))))
        load_format = "dummy"
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    return ModelSpec(path=path, load_format=load_format,
                     vocab_size=int(config["vocab_size"]),
                     max_position_embeddings=int(config.get("max_position_embeddings", 1 << 30)))


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def scaled(n: int, scale: float) -> int:
    """n shrunk by scale, at least 1."""
    return max(1, round(n * scale))


def fit_vocab(token_ids: list[int], vocab_size: int) -> list[int]:
    """Fold ids into a tiny test model's vocabulary; a no-op for real vocabularies."""
    if vocab_size > W1_TOKEN_ID_MAX:
        return token_ids
    return [t % vocab_size for t in token_ids]


def w1_requests(num_prompts: int = W1_NUM_PROMPTS, scale: float = 1.0,
                vocab_size: int = W1_TOKEN_ID_MAX + 1) -> list[Request]:
    """W1 (benchmarks/README.md): random.seed(0); all prompts drawn first, each
    [randint(0, 10000) for _ in range(randint(100, 1024))]; then each request's
    max_tokens = randint(100, 1024). With scale < 1 the count and both length ranges
    shrink by that factor (same draw order)."""
    rng = random.Random(0)  # same stream as random.seed(0) + module-level randint
    n = scaled(num_prompts, scale)
    p_lo, p_hi = (scaled(x, scale) for x in W1_PROMPT_LEN)
    o_lo, o_hi = (scaled(x, scale) for x in W1_OUTPUT_LEN)
    prompts = [[rng.randint(0, W1_TOKEN_ID_MAX) for _ in range(rng.randint(p_lo, p_hi))]
               for _ in range(n)]
    max_tokens = [rng.randint(o_lo, o_hi) for _ in range(n)]
    requests = [Request(fit_vocab(p, vocab_size), m) for p, m in zip(prompts, max_tokens)]
    if num_prompts == W1_NUM_PROMPTS and scale == 1.0:
        totals = (sum(r.max_tokens for r in requests), sum(len(r.prompt_token_ids) for r in requests))
        assert totals == (W1_OUTPUT_TOKENS, W1_PROMPT_TOKENS), f"W1 totals drifted: {totals}"
    return requests


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Uniform random token ids in [0, min(10000, vocab_size - 1)]."""
    high = min(W1_TOKEN_ID_MAX, vocab_size - 1)
    return [rng.randint(0, high) for _ in range(length)]


def shuffled_block_tables(blocks_per_seq: list[int], gen: random.Random) -> torch.Tensor:
    """Block tables [B, max(blocks_per_seq)] int32 (CPU): sequence b gets blocks_per_seq[b]
    distinct blocks of a pool of exactly sum(blocks_per_seq), shuffled, as pages lie after a
    long serving run (the rest of each row is 0)."""
    perm = list(range(sum(blocks_per_seq)))
    gen.shuffle(perm)
    table = torch.zeros(len(blocks_per_seq), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for row, n in enumerate(blocks_per_seq):
        table[row, :n] = torch.tensor(perm[start:start + n])
        start += n
    return table


def warmup_prompt(vocab_size: int) -> list[int]:
    """The short warm-up request's prompt; shares nothing with any workload prompt's start."""
    return [(7 * i + 3) % min(W1_TOKEN_ID_MAX, vocab_size) for i in range(32)]


# ---------------------------------------------------------------------- minivllm engine


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Arguments every benchmark takes: the model, engine knobs, size and output."""
    parser.add_argument("--model", default="qwen3-0.6b",
                        help="model directory, or a benchmarks/presets.py preset name (random weights)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="for a directory: 'dummy' ignores its weights (presets are always dummy)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help=f"default {DEFAULT_MAX_MODEL_LEN} (BENCH.md), capped at the model's positions")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                        help="'fp8': an FP8 (e4m3) KV cache")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="'fp8': FP8 weights, quantised at load (a checkpoint's own FP8 weights need no flag)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink the workload (requests and lengths) for CPU smoke runs")
    parser.add_argument("--json-out", default=None, help="append one JSON result line to this file")


def engine_kwargs(args: argparse.Namespace, spec: ModelSpec) -> dict[str, Any]:
    """LLM(...) keyword arguments from the command line; unset knobs keep the engine's defaults."""
    max_model_len = args.max_model_len or min(DEFAULT_MAX_MODEL_LEN, spec.max_position_embeddings)
    kwargs: dict[str, Any] = {"dtype": args.dtype, "max_model_len": max_model_len,
                              "load_format": spec.load_format, "enforce_eager": args.enforce_eager,
                              "seed": 0}
    optional = ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                "tensor_parallel_size", "block_size", "kv_cache_dtype", "quantization")
    kwargs.update({k: getattr(args, k) for k in optional if getattr(args, k) is not None})
    return kwargs


def make_llm(args: argparse.Namespace, spec: ModelSpec, **overrides: Any) -> tuple[Any, float]:
    """Build minivllm's LLM; returns it and the start-up seconds (load, profile, graphs)."""
    from minivllm import LLM

    kwargs = engine_kwargs(args, spec) | overrides
    start = time.perf_counter()
    llm = LLM(spec.path, **kwargs)
    synchronize()
    return llm, time.perf_counter() - start


def startup_metrics(llm: Any, startup: float) -> dict[str, Any]:
    """Start-up seconds, and of them the CUDA-graph capture (None: no graphs, e.g. eager)."""
    graphs = llm.llm_engine.model_runner.graphs
    return {"startup_s": startup, "graph_capture_s": graphs.capture_seconds if graphs else None}


def warmup_llm(llm: Any, vocab_size: int, prefix_hit: bool = False, schema: dict[str, Any] | None = None) -> None:
    """One short request so the timed run sees no first-call costs (with the timed run's JSON
    schema, if any: the grammar backend's start and the schema's compilation); with prefix_hit a
    second one that starts with the first's prompt, so that the prefill-over-a-cached-
    prefix path is compiled too (W3)."""
    prompt = warmup_prompt(vocab_size)
    timed_generate(llm, [Request(prompt, 16)], temperature=0.0, schema=schema)
    if prefix_hit:
        timed_generate(llm, [Request(prompt + prompt[:8], 16)], temperature=0.0)


def timed_generate(llm: Any, requests: list[Request], temperature: float,
                   schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """One timed llm.generate() over the requests (ignore_eos, each its own max_tokens);
    returns throughput_metrics of that run. With a JSON schema every request carries it
    (structured_outputs), and the metrics count the texts that begin with an object valid
    under it (schemas.leading_object_counts; checked after the timed run)."""
    from minivllm import SamplingParams
    from minivllm.sampling_params import StructuredOutputsParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=r.max_tokens,
                             structured_outputs=None if schema is None else StructuredOutputsParams(json=schema))
              for r in requests]
    with Timer() as t:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    metrics = throughput_metrics(requests, output_tokens, t.seconds)
    if schema is not None:
        metrics |= leading_object_counts([o.outputs[0].text for o in outputs], schema)
    return metrics


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several timed runs' summary: the median run's metrics (the lower middle of an even
    count), with output_tok_s the median over the runs and output_tok_s_runs every run's."""
    tok_s = [run["output_tok_s"] for run in runs]
    middle = sorted(runs, key=lambda run: run["output_tok_s"])[(len(runs) - 1) // 2]
    return middle | {"output_tok_s": statistics.median(tok_s), "output_tok_s_runs": tok_s}


def engine_stats(llm: Any) -> dict[str, int]:
    """The engine's cumulative counters (llm.llm_engine.stats()), {} if it has none.
    W3 needs "prefix_cache_queries" (prompt tokens looked up in the prefix cache) and
    "prefix_cache_hits" (of those, tokens found cached); W1 reports "num_preemptions"."""
    stats = getattr(llm.llm_engine, "stats", None)
    return dict(stats()) if callable(stats) else {}


def stats_delta(before: dict[str, int], after: dict[str, int], keys: tuple[str, ...]) -> dict[str, int]:
    """after - before for the counters both snapshots have."""
    return {k: after[k] - before[k] for k in keys if k in before and k in after}


def shutdown_llm(llm: Any) -> None:
    """Stop an engine's workers (tensor-parallel processes), if it has a shutdown()."""
    for owner in (llm, getattr(llm, "llm_engine", None)):
        shutdown = getattr(owner, "shutdown", None)
        if callable(shutdown):
            shutdown()
            return


def free_memory() -> None:
    """Collect a dropped engine and hand its cached GPU memory back (between engines)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ timing


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    """`with Timer() as t: ...` then t.seconds; synchronises the GPU at both ends."""

    seconds: float = 0.0

    def __enter__(self) -> Timer:
        synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize()
        self.seconds = time.perf_counter() - self._start


def throughput_metrics(requests: list[Request], output_tokens: int, elapsed: float) -> dict[str, Any]:
    """Output tok/s, total tok/s, requests/s for one timed run."""
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return {
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.max_tokens for r in requests),
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "requests_s": len(requests) / elapsed,
    }


# ----------------------------------------------------------------------------- results


def git_commit() -> str:
    """HEAD of this checkout (read only), or $MINIVLLM_COMMIT where there is no .git."""
    if commit := os.environ.get("MINIVLLM_COMMIT"):
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "commit": git_commit(),
        "torch": torch.__version__,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def report(workload: str, backend: str, args: argparse.Namespace, metrics: dict[str, Any]) -> None:
    """Print the metrics and append one JSON line (environment + metrics) to --json-out."""
    print(f"== {workload} [{backend}] model={args.model} scale={args.scale}")
    for key, value in metrics.items():
        print(f"  {key:>28}: {_show(value)}")
    if args.json_out:
        line = {"workload": workload, "backend": backend, "model": args.model, "scale": args.scale,
                **environment(), **metrics}
        with open(args.json_out, "a") as f:
            f.write(json.dumps(line) + "\n")


def step_kind(num_seqs: int, num_tokens: int) -> str:
    if num_tokens > num_seqs:
        return "prefill/mixed"
    bound = next((b for b in (8, 32, 128) if num_seqs < b), None)
    return f"decode <{bound}" if bound else "decode >=128"


def record_step_kinds(llm: Any) -> Callable[[], dict[str, dict[str, float]]]:
    """Wrap the runner's launches to time each interval between forward-pass launches by the
    kind of the step launched at its start, and (on CUDA) the device time of each step's queued
    work, between events recorded before its forward pass and after its sampling are queued:
    where an interval exceeds its step's device time, the device waited for the host (an eager
    step's device time includes its waits for the host's launches). The returned function gives
    the totals, and the seconds outside every interval ("outside steps": from this call to the
    first launch, and from the last launch to the returned function's call: the request intake
    before the first step, the last step and the outputs after it), and puts the runner's own
    launches back."""
    runner = llm.llm_engine.model_runner
    launch_forward, launch_sampling = runner.launch_forward, runner.launch_sampling
    launches: list[list[Any]] = []  # [start, kind, begin event, end event]
    recording_since = time.perf_counter()
    timing = torch.cuda.is_available()

    def timed_forward(prepared: Any) -> Any:  # a PreparedStep; a ForwardPass or None
        start = time.perf_counter()
        begin = torch.cuda.Event(enable_timing=True) if timing else None
        if begin is not None:
            begin.record()
        forward = launch_forward(prepared)
        rows = prepared.rows
        launches.append([start, step_kind(len(rows.states), rows.num_tokens), begin, None])
        return forward

    def timed_sampling(*args: Any) -> Any:  # (ForwardPass, GrammarBitmask | None); a StepHandle
        handle = launch_sampling(*args)
        if timing and launches:
            launches[-1][3] = torch.cuda.Event(enable_timing=True)
            launches[-1][3].record()
        return handle
    runner.launch_forward, runner.launch_sampling = timed_forward, timed_sampling

    def totals() -> dict[str, dict[str, float]]:
        del runner.launch_forward, runner.launch_sampling  # the instance attributes set above: the class's again
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ended = time.perf_counter()
        sums: dict[str, dict[str, float]] = defaultdict(lambda: {"steps": 0, "seconds": 0.0, "gpu_seconds": 0.0})
        for (start, kind, begin, end), (next_start, *_) in pairwise(launches):
            sums[kind]["steps"] += 1
            sums[kind]["seconds"] += next_start - start
            if begin is not None and end is not None:  # (end: None where nothing sampled)
                sums[kind]["gpu_seconds"] += begin.elapsed_time(end) / 1e3
        breakdown = {kind: {"steps": v["steps"], "seconds": round(v["seconds"], 3),
                            "ms_per_step": round(1e3 * v["seconds"] / v["steps"], 3),
                            "gpu_ms_per_step": round(1e3 * v["gpu_seconds"] / v["steps"], 3)}
                     for kind, v in sorted(sums.items())}
        if launches:
            breakdown["outside steps"] = {"before_first_launch_s": round(launches[0][0] - recording_since, 4),
                                          "after_last_launch_s": round(ended - launches[-1][0], 4)}
        return breakdown
    return totals
