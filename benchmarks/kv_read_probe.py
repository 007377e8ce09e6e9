"""How fast can any decode kernel read W1's K/V pages, by access pattern? (A probe, GPU only.)

The decode kernel reads its pages within 2.4 % of a kernel that only reads them in the same
pattern (session 8: 3.61 vs 3.52 s for W1), i.e. ~4.1 TB/s: attention math is not what is
left. What is left is the pattern. The cache is [blocks, 16 tokens, 8 KV heads, 128] per
layer for K and for V, so one (sequence, KV head) program, as the engine launches them,
reads 256-byte rows 2 KiB apart; a program that takes all 8 KV heads of its sequence reads
each 32 KiB page whole. This times reading the same pages (no math: a sum that the compiler
must keep) with HEADS KV heads per program (1: the engine's pattern; 8: whole pages), the
sequences longest first and split along the keys as the engine splits them, on W1's batches,
against streaming the same number of bytes from one flat buffer (the ceiling for reads).

If whole pages read markedly faster than 256-byte rows (more than ~5 %), a decode kernel
with one program per sequence for all KV heads (the GQA groups of all heads as one tile)
is the next step for W1's attention; if not, the pattern is not the limit either.

    python benchmarks/kv_read_probe.py [--every 128]
"""

import argparse
import random
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, uninstalled
from benchmarks.common import DEFAULT_MAX_MODEL_LEN  # noqa: E402
from benchmarks.decode_w1 import BLOCK, D, HKV, MIN_BYTES_PER_TIMING, build_layers, w1_decode_batches  # noqa: E402
from minivllm.executor.cuda_graphs import graph_batch_sizes  # noqa: E402
from minivllm.kernels import paged_attention as pa  # noqa: E402
from minivllm.kernels import sm_count  # noqa: E402


@triton.jit(do_not_specialize=["num_splits"])
def _read_pages_kernel(k_ptr, v_ptr, seq_lens_ptr, block_tables_ptr, out_ptr,
                       stride_cb, stride_cs, stride_bt, num_splits,
                       HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Program (head group, split, sequence) sums its keys' K and V rows of HEADS heads."""
    group = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    kv_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = ((kv_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, (kv_len + BLOCK_N - 1) // BLOCK_N)
    cols = group * HEADS * HEAD_DIM + tl.arange(0, HEADS * HEAD_DIM)  # HEADS neighbouring rows
    acc = tl.zeros([HEADS * HEAD_DIM], tl.float32)
    for t in range(first, last):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = offs_n < kv_len
        block_ids = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + offs_n // BLOCK_SIZE,
                            mask=valid, other=0)
        offs = block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs
        ptrs = offs[:, None] + cols[None, :]
        k = tl.load(k_ptr + ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + ptrs, mask=valid[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    tl.store(out_ptr + (seq * num_splits + split) * tl.num_programs(0) + group, tl.sum(acc, axis=0))


@triton.jit
def _read_flat_kernel(x_ptr, out_ptr, n, chunk, BLOCK: tl.constexpr):
    """Program p sums elements [p * chunk, (p + 1) * chunk) of a flat buffer."""
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(p * chunk, tl.minimum((p + 1) * chunk, n), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def time_pages(seq_lens: list[int], heads: int, num_splits: int, block_n: int, num_warps: int,
               gen: random.Random) -> float:
    """Seconds per layer to read the batch's pages, HEADS KV heads per program."""
    layers = build_layers(seq_lens, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty(len(seq_lens) * num_splits * (HKV // heads), dtype=torch.float32, device="cuda")
    grid = (HKV // heads, num_splits, len(seq_lens))

    def step() -> None:
        for k_cache, v_cache, table in layers:
            _read_pages_kernel[grid](k_cache, v_cache, lens, table, out, k_cache.stride(0), k_cache.stride(1),
                                     table.stride(0), num_splits, HEADS=heads, HEAD_DIM=D, BLOCK_SIZE=BLOCK,
                                     BLOCK_N=block_n, num_warps=num_warps)
    step()
    return triton.testing.do_bench_cudagraph(step, rep=60, return_mode="median") * 1e-3 / len(layers)


def time_flat(num_bytes: int, programs: int) -> float:
    """Seconds to read num_bytes from a flat buffer (as many buffers as beat L2, one after another)."""
    n = num_bytes // 2
    buffers = [torch.randn(n, dtype=torch.bfloat16, device="cuda")
               for _ in range(max(1, int(MIN_BYTES_PER_TIMING // num_bytes) + 1))]
    out = torch.empty(programs, dtype=torch.float32, device="cuda")
    chunk = triton.cdiv(triton.cdiv(n, programs), 4096) * 4096

    def step() -> None:
        for x in buffers:
            _read_flat_kernel[(triton.cdiv(n, chunk),)](x, out, n, chunk, BLOCK=4096, num_warps=8)
    step()
    return triton.testing.do_bench_cudagraph(step, rep=60, return_mode="median") * 1e-3 / len(buffers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=128, help="time every this many'th decode step of W1")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kv_read_probe.py needs a CUDA GPU")
    torch.manual_seed(0)
    gen = random.Random(0)
    sms = sm_count(torch.device("cuda"))
    sizes = graph_batch_sizes(256)
    # (name, heads per program, splits relative to the engine's, BLOCK_N, warps)
    variants = [("1 head/program (engine)", 1, 1, 32, 4),
                ("2 heads", 2, 1, 32, 4), ("4 heads", 4, 1, 16, 4),
                ("8 heads (whole pages)", 8, 1, 16, 4), ("8 heads, 8 warps", 8, 1, 16, 8),
                ("8 heads, 8x splits", 8, 8, 16, 4), ("8 heads, 4x splits, 8 warps", 8, 4, 16, 8)]
    totals = dict.fromkeys([v[0] for v in variants] + ["flat stream"], 0.0)
    print(f"GPU: {torch.cuda.get_device_name()}; W1 decode steps every {args.every}; K+V bytes / time per layer",
          flush=True)
    for step, seq_lens in w1_decode_batches(args.every):
        seq_lens = sorted(seq_lens, reverse=True)  # as the runner orders decodes
        padded = next(s for s in sizes if s >= len(seq_lens))
        splits = pa.decode_num_splits(padded, HKV, DEFAULT_MAX_MODEL_LEN, sms)
        layer_bytes = sum(seq_lens) * HKV * D * 2 * 2
        seconds = {name: time_pages(seq_lens, heads, min(pa.DECODE_MAX_SPLITS, splits * more), block_n, warps, gen)
                   for name, heads, more, block_n, warps in variants}
        seconds["flat stream"] = time_flat(layer_bytes, 4 * sms)
        for name, t in seconds.items():
            totals[name] += t * 28 * args.every
        print(f"step {step:4d} batch {len(seq_lens):3d} (engine splits {splits}): " + " | ".join(
            f"{name}: {t * 1e6:6.1f} us {layer_bytes / t / 1e12:4.2f} TB/s" for name, t in seconds.items()), flush=True)
    print("\nW1's decode K/V reads, estimated from these steps (28 layers):")
    for name, t in totals.items():
        print(f"  {name:32s} {t:6.3f} s")


if __name__ == "__main__":
    main()
