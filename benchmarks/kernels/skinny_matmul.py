"""Small-batch linear layers: cuBLAS (F.linear) vs minivllm's skinny_matmul (GPU only).

    python -m benchmarks.kernels.skinny_matmul           # the table (~1 min)
    python -m benchmarks.kernels.skinny_matmul --sweep   # also other tiles and split-K counts of the Triton kernel

Qwen3-0.6B's and Qwen3-8B's projections (qkv, o, gate_up, down), bf16, at batch 1, 4, 8 and 16,
captured in a CUDA graph as a decode step runs them (triton.testing.do_bench_cudagraph, median).
As in a step, the weights come from HBM, not L2: each timed graph runs the projection over
distinct copies of the weight, one per layer, at least 256 MB in all (L2 is 50 MB), and the
table gives the time per call. GB/s counts the weight bytes, which dominate: the floor is
weights / bandwidth.
"""

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.testing

from benchmarks.common import kernel_benchmark_args
from minivllm.kernels.skinny_matmul import skinny_matmul, skinny_matmul_config

SHAPES = {  # name: (N, K)
    "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (24576, 4096), "8b down": (4096, 12288),
}
BATCHES = (1, 4, 8, 16)
DTYPE = torch.bfloat16


COLD_BYTES = 256 << 20


def per_call_us(matmul, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Median time of one `matmul(x, w)`, run over every weight in turn inside one graph."""
    def layers() -> None:
        for w in weights:
            matmul(x, w)
    return triton.testing.do_bench_cudagraph(layers, rep=20, return_mode="median") * 1e3 / len(weights)


def main() -> None:
    args, _ = kernel_benchmark_args(__doc__, "also time other tile configs")
    print(f"{'shape':<14}{'M':>4}{'cuBLAS us':>11}{'triton us':>11}{'cuBLAS GB/s':>13}{'triton GB/s':>13}"
          f"{'max |diff|':>12}")
    totals = {m: [0.0, 0.0] for m in BATCHES}
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5
        nbytes = weight.numel() * weight.element_size()
        weights = [weight] + [weight.clone() for _ in range(-(-COLD_BYTES // nbytes) - 1)]
        print(f"{name}: default config {skinny_matmul_config(DTYPE, n, k, weight.device)}")
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            diff = (skinny_matmul(x, weight).float() - F.linear(x, weight).float()).abs().max().item()
            t_cublas = per_call_us(F.linear, x, weights)
            t_triton = per_call_us(skinny_matmul, x, weights)
            if name.startswith("0.6b"):
                totals[m][0] += t_cublas
                totals[m][1] += t_triton
            print(f"{name:<14}{m:>4}{t_cublas:>11.1f}{t_triton:>11.1f}{nbytes / t_cublas / 1e3:>13.0f}"
                  f"{nbytes / t_triton / 1e3:>13.0f}{diff:>12.3g}", flush=True)
            if args.sweep and m in (1, 16):
                for block_n, block_k, split_k in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8)):
                    if split_k * block_k > k:
                        continue
                    for stages, warps in itertools.product((3, 4, 6), (4, 8)):
                        cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps,
                                   num_stages=stages)
                        try:
                            t = per_call_us(lambda a, w, cfg=cfg: skinny_matmul(a, w, config=cfg), x, weights)
                        except triton.runtime.errors.OutOfResources:
                            continue
                        print(f"    {cfg}: {t:.1f} us ({nbytes / t / 1e3:.0f} GB/s)")
    for m, (t_cublas, t_triton) in totals.items():
        print(f"Qwen3-0.6B layer's four projections at M={m}: cuBLAS {t_cublas:.1f} us, triton {t_triton:.1f} us "
              f"(x 28 layers: {28 * (t_cublas - t_triton) / 1e3:+.2f} ms per step saved)")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
