"""Microbenchmark of the Triton mixture-of-experts kernel (GPU only).

    python -m benchmarks.kernels.fused_moe           # the configured tiles (CONFIGS)
    python -m benchmarks.kernels.fused_moe --sweep   # also candidate tiles per batch size
    python -m benchmarks.kernels.fused_moe --fp8 block   # also FP8 experts (or --fp8 channel)

Qwen3-30B-A3B's MoE layer on one GPU: E=128 experts, H=2048, I=768, top-8, bf16, routing
uniform at random (top-8 of random logits), T from 1 to 8192 tokens. Each fused_moe call
(alignment, both grouped GEMMs, the sum) is captured in a CUDA graph, as a decode step runs
it, and timed with CUDA events around each replay: median of REPEATS replays after WARMUP,
each replay with the next of ROUTINGS routings (so that the experts it hits are not all in
L2 from the replay before). Reported per T: time, the alignment kernel's time alone, the
floor (bytes that must move: the weights of every expert hit, plus the activations in and
out, over the device copy bandwidth), achieved TB/s and TFLOP/s (6 * H * I per (token,
slot)). --sweep times candidate tiles at every T and prints the best as a CONFIGS table.

--fp8 block (Qwen3-30B-A3B-FP8's format: 128x128 weight blocks, activations quantised per
token and 128 columns) or --fp8 channel (quantization="fp8": per-channel weights, per-token
activations) also times the same layer with float8 experts, at the default tiles, beside each
T's bf16 line: the call as FusedMoE makes it (`fp8`: each projection's input quantised by
layers/fp8_linear.py first), and with the weights alone in FP8 (`fp8 w-only`: no
activation quantisation). Their floor counts one byte a weight.
"""

import argparse
import statistics
from collections.abc import Callable

import torch
import triton

from benchmarks.common import kernel_benchmark_args
from minivllm.kernels.fused_moe import Fp8Experts, fused_moe, fused_moe_config, moe_align
from minivllm.layers.fp8_linear import FP8, quantize_activations

E, H, I, TOP_K = 128, 2048, 768, 8  # noqa: E741 (I: the intermediate size, in the docstring's notation)
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64, 128, 256, 512, 1024, 4096, 8192)
ROUTINGS, WARMUP, REPEATS = 8, 5, 30

# Sweep candidates: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); each batch
# tries those whose BLOCK_M suits its rows per expert (candidate_fits).
CANDIDATES = [
    (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 3),
    (16, 64, 64, 1, 4, 6), (16, 64, 128, 4, 4, 4),
    (32, 64, 128, 8, 4, 4), (32, 128, 64, 8, 4, 4),
    (64, 64, 128, 8, 4, 3), (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 1, 8, 3), (128, 64, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4),
]
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def candidate_fits(block_m: int, num_tokens: int) -> bool:
    """Row blocks between an eighth of and twice the mean rows per expert (at least 16)."""
    rows = num_tokens * TOP_K / E
    return max(16.0, rows / 8) <= block_m <= max(16.0, 2 * rows)


def routings(num_tokens: int) -> list[torch.Tensor]:
    """ROUTINGS random top-k choices (distinct experts per token), int64 [T, k]."""
    return [torch.randn(num_tokens, E, device="cuda").topk(TOP_K, dim=-1).indices for _ in range(ROUTINGS)]


def time_graph_us(fn: Callable[[], object], ids: torch.Tensor, choices: list[torch.Tensor]) -> float:
    """Median µs of one replay of fn captured in a CUDA graph, ids refilled from choices
    before each replay (outside the timed span)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(WARMUP + REPEATS)]
    for i, (start, end) in enumerate(events):
        ids.copy_(choices[i % len(choices)])
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events[WARMUP:]) * 1e3


def floor_bytes(choices: list[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor) -> float:
    """Mean over the routings of the bytes a call must move: hit experts' weights, x and out."""
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    hit = statistics.mean(c.unique().numel() for c in choices)
    return hit * per_expert + 2 * choices[0].shape[0] * H * DTYPE.itemsize


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor, scheme: str
                ) -> tuple[torch.Tensor, torch.Tensor, Fp8Experts, Fp8Experts]:
    """w13 and w2 in float8 as scheme ("block": 128x128 blocks, "channel") has them, and their
    Fp8Experts: with the scheme's activation quantisation, and weights only."""
    block = (128, 128) if scheme == "block" else None

    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if block is None:
            scale = w.float().abs().amax(dim=2) / torch.finfo(FP8).max
            return (w.float() / scale[..., None]).to(FP8), scale
        e, n, k = w.shape
        blocks = w.float().view(e, n // block[0], block[0], k // block[1], block[1])
        scale = blocks.abs().amax(dim=(2, 4)) / torch.finfo(FP8).max
        return (blocks / scale[:, :, None, :, None]).to(FP8).view(e, n, k), scale

    (w13_q, w13_scale), (w2_q, w2_scale) = quantize(w13), quantize(w2)

    def quantize_input(x: torch.Tensor, projection: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_activations(x, None if block is None else block[1], None)

    return (w13_q, w2_q, Fp8Experts(w13_scale, w2_scale, block, quantize_input),
            Fp8Experts(w13_scale, w2_scale, block, None))


def bench_batch(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, sweep: bool, peak: float,
                fp8: tuple[torch.Tensor, torch.Tensor, Fp8Experts, Fp8Experts] | None
                ) -> tuple[float, dict[str, int]]:
    """Print one line per config timed at this batch size (and, with fp8, one per FP8 variant at
    the default config); return the fastest bf16 (µs, config)."""
    x = torch.randn(num_tokens, H, device="cuda", dtype=DTYPE)
    choices = routings(num_tokens)
    ids = choices[0].clone()
    weights = torch.rand(num_tokens, TOP_K, device="cuda").softmax(-1)
    nbytes = floor_bytes(choices, w13, w2)
    flops = 6 * H * I * num_tokens * TOP_K
    default = fused_moe_config(num_tokens, DTYPE)
    variants = [default]
    if sweep:
        variants += [cfg for c in CANDIDATES if candidate_fits(c[0], num_tokens)
                     and (cfg := dict(zip(CONFIG_KEYS, c))) != default]
    want = fused_moe(x, w13, w2, weights, ids)
    checked_ids = ids.clone()  # timing refills ids with other routings
    best = (float("inf"), default)
    for cfg in variants:
        ids.copy_(checked_ids)
        try:
            got = fused_moe(x, w13, w2, weights, ids, config=cfg)
        except triton.runtime.errors.OutOfResources:
            print(f"{'':>46}  {cfg}: out of resources")
            continue
        error = (got.float() - want.float()).abs().max().item()
        if error > 2e-2 * (1 + want.float().abs().max().item()):
            print(f"{'':>46}  {cfg}: DISAGREES with the default (max |diff| {error:.3g})")
            continue
        t = time_graph_us(lambda cfg=cfg: fused_moe(x, w13, w2, weights, ids, config=cfg), ids, choices)
        t_align = time_graph_us(lambda cfg=cfg: moe_align(ids, E, cfg["BLOCK_M"]), ids, choices)
        best = min(best, (t, cfg), key=lambda pair: pair[0])
        print(f"{num_tokens:>6}{t:>10.1f}{t_align:>10.1f}{nbytes / peak * 1e6:>10.1f}"
              f"{nbytes / t / 1e6:>7.2f}{flops / t / 1e6:>9.1f}  {cfg}{' (default)' if cfg is default else ''}",
              flush=True)
    if fp8 is not None:
        w13_q, w2_q = fp8[:2]
        fp8_bytes = floor_bytes(choices, w13_q, w2_q)
        for label, experts in (("fp8", fp8[2]), ("fp8 w-only", fp8[3])):
            ids.copy_(checked_ids)
            got = fused_moe(x, w13_q, w2_q, weights, ids, fp8=experts)
            error = (got.float() - want.float()).abs().max().item()
            t = time_graph_us(lambda experts=experts: fused_moe(x, w13_q, w2_q, weights, ids, fp8=experts),
                              ids, choices)
            print(f"{num_tokens:>6}{t:>10.1f}{'':>10}{fp8_bytes / peak * 1e6:>10.1f}{fp8_bytes / t / 1e6:>7.2f}"
                  f"{flops / t / 1e6:>9.1f}  {label} (max |diff| from bf16 {error:.3g})", flush=True)
    return best


def main() -> None:
    def add_fp8(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--fp8", choices=["block", "channel"], default=None,
                            help="also time FP8 experts: 128x128 blocks or per-channel scales")

    args, peak = kernel_benchmark_args(__doc__, "also time candidate tiles at every batch size", add_fp8)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=DTYPE) / H ** 0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=DTYPE) / I ** 0.5
    fp8 = None if args.fp8 is None else fp8_experts(w13, w2, args.fp8)
    print(f"E={E} H={H} I={I} top-{TOP_K} {DTYPE}; weights {(w13.nbytes + w2.nbytes) / 1e9:.2f} GB"
          f"{'' if fp8 is None else f'; FP8 ({args.fp8} scales) beside'}")
    print(f"{'T':>6}{'us':>10}{'align us':>10}{'floor us':>10}{'TB/s':>7}{'TFLOP/s':>9}  config")
    best = {num_tokens: bench_batch(num_tokens, w13, w2, args.sweep, peak, fp8) for num_tokens in BATCHES}
    if args.sweep:
        print("best per T:")
        for num_tokens, (t, cfg) in best.items():
            print(f"    {num_tokens}: {t:.1f} us  {cfg}")


if __name__ == "__main__":
    main()
