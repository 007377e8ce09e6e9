"""W5 on vLLM 0.20.1: W1's requests (benchmarks/README.md) on Qwen3-30B-A3B with dummy weights,
bf16, timed as the staged .vl/tools/vllm_w1.py times W1. Run on the accelerator once vLLM is
staged and installed there (benchmarks/README.md):

    PYTHONPATH=/tmp/vlsite:. python3 scripts/vllm_w5.py [--n 256] [--quantization fp8] [--preset qwen3-30b-a3b-fp8]
    PYTHONPATH=/tmp/vlsite:. python3 scripts/vllm_w5.py --preset qwen3-8b --quantization fp8 --kv-cache-dtype fp8

Our side of the same workload: `python3 -m benchmarks.throughput --model qwen3-30b-a3b` (with the
same --quantization, or --model qwen3-30b-a3b-fp8 for the block-scaled FP8 checkpoint's config).
"""

import argparse
import os
import sys
import time

for key, value in {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1", "VLLM_CACHE_ROOT": "/tmp/vllm-cache",
                   "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
    os.environ.setdefault(key, value)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".vl", "tools"))

from workload import w1  # noqa: E402 (the W1 generator, on the sys.path set above)

from benchmarks.presets import write_preset  # noqa: E402 (after the environment is set for vLLM)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=256, help="number of W1 requests")
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="benchmarks/presets.py's config")
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="'fp8': quantised at load")
    parser.add_argument("--model-dir", default=None, help="default /tmp/<preset>-config")
    parser.add_argument("--kv-cache-dtype", default="auto", help="'fp8': the FP8 KV cache")
    args = parser.parse_args()
    model_dir = write_preset(args.preset, args.model_dir or f"/tmp/{args.preset}-config")
    prompts, max_tokens = w1(args.n)
    start = time.perf_counter()
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096,
              skip_tokenizer_init=True, seed=0, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    print(f"vllm W5 startup {time.perf_counter() - start:.1f}s", flush=True)
    warm = [{"prompt_token_ids": p[:64]} for p in prompts[:8]]
    llm.generate(warm, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"vllm W5 ({args.preset}, quantization {args.quantization}, KV cache {args.kv_cache_dtype}): "
          f"output tokens {tokens}, "
          f"time {elapsed:.2f} s, throughput {tokens / elapsed:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
