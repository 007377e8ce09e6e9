"""Could a Triton GEMM beat cuBLAS on decode steps' projections at 32-256 rows? (A probe, GPU only.)

At batch 256 the four cuBLAS GEMMs of a Qwen3-0.6B layer take 28 µs (session 8's step profile:
7.7, 7.5, 6.5, 6.4 µs), where their FLOPs at 790 TFLOP/s take 10.2 µs and their weights 7.1 µs
to read: 0.78 ms of a 6.9 ms step, the largest piece of a decode step after attention. cuBLAS
picks small tiles (64 x 32 for the o projection) to give 132 SMs work: narrow tensor-core
instructions and each weight tile re-read per batch tile. The other way to fill the SMs is
split-K with wide tiles: here a program multiplies BLOCK_OUT weight rows by BLOCK_B batch rows
(out^T = W x^T, so that the weight rows are the tensor cores' M and the batch their N, as
cuBLAS lays it out) over one of SPLIT_K slices of K; with SPLIT_K > 1, fp32 partials go to a
workspace and a second kernel adds them in split order and casts (a real kernel would do it in
one launch, like skinny_matmul's last-program reduction; both kernels are timed here).

Every config's result is checked against F.linear first. Weights come from HBM (distinct
copies, 256 MB in all, as skinny_matmul.py's timings).

    python benchmarks/gemm_probe.py [--rows 64 128 256]
    TRITON_INTERPRET=1 python benchmarks/gemm_probe.py --check    # CPU: correctness only
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, uninstalled
from benchmarks.skinny_matmul import COLD_BYTES, SHAPES, per_call_us  # noqa: E402


@triton.jit(do_not_specialize=["split_len"])
def _gemm_partial_kernel(x_ptr, w_ptr, out_ptr, M, N, K, split_len,
                         BLOCK_OUT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                         PARTIAL: tl.constexpr):
    """Program (out tile, batch tile, split): out[b, n] (+)= sum_k x[b, k] W[n, k] over its K slice.
    PARTIAL: write fp32 to out_ptr[split, M, N]; else the output dtype to out_ptr[M, N]."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = pid_n * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * split_len
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + (k_begin + offs_k)[None, :]  # [OUT, K]
    x_ptrs = x_ptr + offs_b[None, :].to(tl.int64) * K + (k_begin + offs_k)[:, None]  # [K, B]
    acc = tl.zeros([BLOCK_OUT, BLOCK_B], tl.float32)
    for k in range(k_begin, tl.minimum(k_begin + split_len, K), BLOCK_K):
        w = tl.load(w_ptrs, mask=offs_n[:, None] < N, other=0.0)
        x = tl.load(x_ptrs, mask=offs_b[None, :] < M, other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    mask = (offs_n[:, None] < N) & (offs_b[None, :] < M)
    out_offs = offs_b[None, :] * N + offs_n[:, None]  # the transposed tile back to [M, N]
    if PARTIAL:
        tl.store(out_ptr + split * M * N + out_offs, acc, mask=mask)
    else:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, num_splits, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: dict, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T with one config: BLOCK_OUT, BLOCK_B, BLOCK_K, SPLIT_K, num_warps, num_stages."""
    (m, k), n = x.shape, w.shape[0]
    split_k = cfg["SPLIT_K"]
    split_len = triton.cdiv(triton.cdiv(k, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = split_k > 1
    if partial and workspace is None:
        workspace = torch.empty(split_k * m * n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_OUT"]), triton.cdiv(m, cfg["BLOCK_B"]), triton.cdiv(k, split_len))
    _gemm_partial_kernel[grid](x, w, workspace if partial else out, m, n, k, split_len,
                               BLOCK_OUT=cfg["BLOCK_OUT"], BLOCK_B=cfg["BLOCK_B"], BLOCK_K=cfg["BLOCK_K"],
                               PARTIAL=partial, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if partial:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](workspace, out, m * n, grid[2], BLOCK=1024, num_warps=4)
    return out


def configs(m: int) -> list[dict]:
    """Tiles up to 128 x 256, 1-8 splits; 8 warps for tiles above 128 x 128 (one compile each)."""
    return [dict(BLOCK_OUT=block_out, BLOCK_B=block_b, BLOCK_K=block_k, SPLIT_K=split_k,
                 num_warps=8 if block_out * block_b > 128 * 128 else 4, num_stages=4)
            for block_out, block_b, block_k, split_k in itertools.product((64, 128), (64, 128, 256), (64, 128),
                                                                          (1, 2, 4, 8))
            if block_b <= max(64, m)]


def check(device: torch.device) -> None:
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for (m, n, k), cfg in itertools.product(((5, 70, 96), (64, 128, 256), (33, 64, 512)),
                                            (dict(BLOCK_OUT=64, BLOCK_B=64, BLOCK_K=32, SPLIT_K=1),
                                             dict(BLOCK_OUT=64, BLOCK_B=64, BLOCK_K=32, SPLIT_K=3))):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        got = triton_linear(x, w, {**cfg, "num_warps": 4, "num_stages": 2}).float()
        want = F.linear(x.float(), w.float())
        error = float((got - want).norm() / want.norm())
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), (m, n, k, cfg, error)
        print(f"ok: M {m} N {n} K {k} {cfg}: relative error {error:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--check", action="store_true", help="only check the kernel (CPU or GPU)")
    args = parser.parse_args()
    if args.check:
        check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return
    if not torch.cuda.is_available():
        sys.exit("timing needs a CUDA GPU (--check runs on CPU under TRITON_INTERPRET=1)")
    check(torch.device("cuda"))
    dtype = torch.bfloat16
    layer = {m: [0.0, 0.0] for m in args.rows}
    for name, (n, k) in SHAPES.items():
        if not name.startswith("0.6b"):
            continue
        weight = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        weights = [weight] + [weight.clone() for _ in range(-(-COLD_BYTES // weight.nbytes) - 1)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            want = F.linear(x, weight).float()
            t_cublas = per_call_us(F.linear, x, weights)
            best = (float("inf"), None)
            for cfg in configs(m):
                if cfg["SPLIT_K"] * cfg["BLOCK_K"] > k:
                    continue
                workspace = torch.empty(cfg["SPLIT_K"] * m * n, dtype=torch.float32, device="cuda")
                try:
                    got = triton_linear(x, weight, cfg, workspace).float()
                except triton.runtime.errors.OutOfResources:
                    continue
                if float((got - want).norm() / want.norm()) > 1e-2:
                    print(f"    WRONG: {cfg}")
                    continue
                t = per_call_us(lambda a, w, cfg=cfg, ws=workspace: triton_linear(a, w, cfg, ws), x, weights)
                best = min(best, (t, cfg), key=lambda b: b[0])
            layer[m][0] += t_cublas
            layer[m][1] += best[0]
            flops = 2 * m * n * k
            print(f"{name:<14} M {m:>3}: cuBLAS {t_cublas:5.1f} us ({flops / t_cublas / 1e6:4.0f} TFLOP/s) | "
                  f"best Triton {best[0]:5.1f} us ({flops / best[0] / 1e6:4.0f} TFLOP/s) {best[1]}", flush=True)
    for m, (t_cublas, t_triton) in layer.items():
        print(f"Qwen3-0.6B layer's four projections at M={m}: cuBLAS {t_cublas:.1f} us, best Triton configs "
              f"{t_triton:.1f} us (x 28 layers: {28 * (t_cublas - t_triton) / 1e3:+.2f} ms per step)")


if __name__ == "__main__":
    main()
