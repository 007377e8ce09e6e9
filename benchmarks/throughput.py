"""W1 — offline throughput on the seed's workload (benchmarks/README.md).

    python -m benchmarks.throughput --model qwen3-0.6b                 # minivllm
    python -m benchmarks.throughput --model qwen3-0.6b --backend hf    # transformers baseline
    python -m benchmarks.throughput --model /path/tiny --scale 0.02    # CPU smoke run
    python -m benchmarks.throughput --model qwen3-0.6b --step-breakdown  # where the time goes
    python -m benchmarks.throughput --model qwen3-0.6b --repeats 3       # the median of 3 runs
    python -m benchmarks.throughput --model qwen3-0.6b --json-schema     # W1 with W6's schema on every request

Start-up (construction: load, profile, graph capture) is timed apart from generate().
--repeats N times N runs on one engine (the prefix cache reset between them) and reports the
median. --step-breakdown also sums the time between successive step launches by kind of step (prefill
or mixed; decode by batch size), and each step's device time. With the device the bottleneck,
the engine launches a step as soon as the one before it finished, so these intervals are the
steps' durations; an interval longer than its step's device time is the device waiting.
--json-schema gives every request W6's JSON schema (structured_outputs=StructuredOutputsParams(
json=...), benchmarks/schemas.py), the warm-up request too, and counts the outputs that begin
with an object valid under it: W1-json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from benchmarks.common import (
    W1_NUM_PROMPTS,
    W1_TEMPERATURE,
    ModelSpec,
    Request,
    Timer,
    add_common_args,
    engine_stats,
    make_llm,
    median_run,
    record_step_kinds,
    report,
    resolve_model,
    shutdown_llm,
    startup_metrics,
    stats_delta,
    throughput_metrics,
    timed_generate,
    w1_requests,
    warmup_llm,
    warmup_prompt,
)
from benchmarks.schemas import w6_schema


def run_minivllm(args: argparse.Namespace, spec: ModelSpec, requests: list[Request]) -> dict[str, Any]:
    """A warmed-up engine's --repeats timed runs of the requests: the run's metrics, or the
    median run's with every run's tok/s. Between runs the prefix cache is reset, so that each
    run finds none of the last one's prompts cached and gets its pages in the same order."""
    llm, startup = make_llm(args, spec)
    schema = w6_schema() if args.json_schema else None
    warmup_llm(llm, spec.vocab_size, schema=schema)
    runs = []
    for repeat in range(args.repeats):
        if repeat and not llm.reset_prefix_cache():
            raise RuntimeError("the engine still holds KV blocks after generate(): a run's requests leaked")
        before = engine_stats(llm)
        breakdown = record_step_kinds(llm) if args.step_breakdown else None
        metrics = timed_generate(llm, requests, W1_TEMPERATURE, schema=schema)
        if breakdown is not None:
            metrics["step_breakdown"] = breakdown()
        runs.append(metrics | stats_delta(before, engine_stats(llm), ("num_preemptions",)))
    shutdown_llm(llm)
    return (median_run(runs) if len(runs) > 1 else runs[0]) | startup_metrics(llm, startup)


# ------------------------------------------------------------------ transformers baseline


def hf_dtype(dtype: str, config: Any) -> torch.dtype:
    if dtype != "auto":
        return {"half": torch.float16, "float": torch.float32}.get(dtype) or getattr(torch, dtype)
    configured = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, configured) if isinstance(configured, str) else configured


def load_hf_model(spec: ModelSpec, dtype: str, device: torch.device) -> Any:
    """transformers' model for the spec: its weights when it has them (load_format auto),
    random weights from the config otherwise, built directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(spec.path)
    kwargs = {"dtype": hf_dtype(dtype, config), "attn_implementation": "sdpa"}
    has_weights = any(Path(spec.path).glob("*.safetensors"))
    if spec.load_format == "auto" and has_weights:
        model = AutoModelForCausalLM.from_pretrained(spec.path, **kwargs).to(device)
    else:
        with device:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.eval()


def hf_generation_config(max_new_tokens: int, eos_token_id: int | None) -> Any:
    """W1's sampling (temperature 0.6, no top-k/top-p) for transformers."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=True, temperature=W1_TEMPERATURE, top_k=0, top_p=1.0,
                            max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0)


def cb_generate(manager: Any, requests: list[Request], tag: str) -> int:
    """Push requests through a running ContinuousBatchingManager; returns tokens generated.
    EOS is off (eos_token_id=-1), so every request runs to its own max_tokens."""
    pending = {manager.add_request(r.prompt_token_ids, request_id=f"{tag}{i}",
                                   max_new_tokens=r.max_tokens, eos_token_id=-1)
               for i, r in enumerate(requests)}
    generated = 0
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
            generated += len(result.generated_tokens)
            pending.discard(result.request_id)
    return generated


class HfRun(NamedTuple):
    generated: int  # output tokens the requests asked for and got
    elapsed: float  # the timed run
    startup: float  # after loading: manager set-up and graph capture, warm-up request
    attn_implementation: str  # as used during the run


def run_hf_continuous_batching(model: Any, requests: list[Request], vocab_size: int) -> HfRun:
    """transformers 5.x continuous batching (paged attention), requests with their own
    max_new_tokens."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                          max_generated_length=max(r.max_tokens for r in requests),
                          num_requests=len(requests))
    generation_config = hf_generation_config(hints.max_generated_length, eos_token_id=-1)
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=generation_config, workload_hints=hints,
                                                   warmup=True, block=True, timeout=30) as manager:
        cb_generate(manager, [Request(warmup_prompt(vocab_size), 16)], tag="warmup")
        startup = time.perf_counter() - start
        with Timer() as t:
            generated = cb_generate(manager, requests, tag="req")
        attn = model.config._attn_implementation  # the manager switches it while running
    return HfRun(generated, t.seconds, startup, attn)


def static_generate(model: Any, batch: list[Request], device: torch.device) -> int:
    """One left-padded model.generate() call for the batch; every row runs to the batch's
    longest max_tokens. Returns the tokens the requests asked for (the rest is waste)."""
    width = max(len(r.prompt_token_ids) for r in batch)
    new_tokens = max(r.max_tokens for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         generation_config=hf_generation_config(new_tokens, eos_token_id=None),
                         min_new_tokens=new_tokens)  # min = max: EOS can never end a row
    assert out.shape[1] == width + new_tokens, "transformers stopped before max_new_tokens"
    return sum(r.max_tokens for r in batch)


def run_hf_static(model: Any, requests: list[Request], batch_size: int, vocab_size: int,
                  device: torch.device) -> HfRun:
    """Plain batched generate(), batches of similar max_tokens."""
    with Timer() as warm:
        static_generate(model, [Request(warmup_prompt(vocab_size), 16)], device)
    ordered = sorted(requests, key=lambda r: r.max_tokens, reverse=True)
    with Timer() as t:
        generated = sum(static_generate(model, ordered[i:i + batch_size], device)
                        for i in range(0, len(ordered), batch_size))
    return HfRun(generated, t.seconds, warm.seconds, model.config._attn_implementation)


def run_hf(args: argparse.Namespace, spec: ModelSpec, requests: list[Request]) -> dict[str, Any]:
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with Timer() as load:
        model = load_hf_model(spec, args.dtype, device)
    mode = args.hf_mode
    if mode == "auto":
        mode = "cb" if hasattr(model, "continuous_batching_context_manager") else "static"
    if mode == "cb":  # not under inference_mode: transformers 5.17 runs its loop in a thread without it
        result = run_hf_continuous_batching(model, requests, spec.vocab_size)
    else:
        with torch.inference_mode():
            result = run_hf_static(model, requests, args.hf_batch_size, spec.vocab_size, device)
    return throughput_metrics(requests, result.generated, result.elapsed) | {
        "startup_s": load.seconds + result.startup, "hf_mode": mode, "dtype": str(model.dtype),
        "attn_implementation": result.attn_implementation, "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--backend", default="minivllm", choices=["minivllm", "hf"])
    parser.add_argument("--num-prompts", type=int, default=W1_NUM_PROMPTS)
    parser.add_argument("--hf-mode", default="auto", choices=["auto", "cb", "static"],
                        help="hf backend: continuous batching (cb, transformers 5.x) or static batches")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="hf static mode: requests per batch")
    parser.add_argument("--step-breakdown", action="store_true",
                        help="minivllm: time per kind of step (prefill/mixed, decode by batch size)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="minivllm: timed runs on one engine (the median is reported, with every run's tok/s)")
    parser.add_argument("--json-schema", action="store_true",
                        help="minivllm: every request carries W6's JSON schema (W1-json)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.json_schema and args.backend != "minivllm":
        parser.error("--json-schema is for the minivllm backend")

    spec = resolve_model(args.model, args.load_format)
    requests = w1_requests(args.num_prompts, args.scale, spec.vocab_size)
    run = run_minivllm if args.backend == "minivllm" else run_hf
    report("W1-json" if args.json_schema else "W1", args.backend, args, run(args, spec, requests))


if __name__ == "__main__":
    main()
