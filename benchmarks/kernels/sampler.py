"""Microbenchmark of random sampling: the old torch passes vs the Gumbel-max kernels (GPU only).

    python -m benchmarks.kernels.sampler            # the table (< 1 min)
    python -m benchmarks.kernels.sampler --sweep    # also try other chunk sizes, warp counts, chunks a program

Logits [B, V] in bf16 (the lm head's dtype), V = 151,936 (Qwen3's vocabulary), B = 1, 64,
256; every row random with temperature 0.6 (W1's sampling). Variants:

* torch     the sampler's passes before the kernel: float32 copy, divide by T, softmax,
            Exp(1) noise, clamp, divide, argmax (what minivllm/layers/sampler.py ran)
* kernel    minivllm/kernels/sampling.py on the bf16 logits, T applied in the kernel (the
            sampler's path without penalties, min_tokens or filters)
* kernel32  the kernel on a float32 copy, T = 1 (the path after penalties or filters, which
            work on a float32 copy; the copy and the filters themselves are not timed)
* sampler   Sampler()(logits, meta), built under use_triton_kernels, for the same rows: the per-row
            seed draw plus the kernel

Times are do_bench medians in microseconds (each call launched from Python, L2 flushed
between calls). GB/s is the floor's traffic, the variant's input logits read once, over
the time; "% copy" compares it with a device-to-device copy's bandwidth.
"""

from collections.abc import Callable

import torch
import triton
import triton.testing

from benchmarks.common import kernel_benchmark_args
from minivllm.kernels import sampling
from minivllm.layers.custom_op import use_triton_kernels
from minivllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from minivllm.sampling_params import SamplingParams

VOCAB = 151_936
TEMPERATURE = 0.6
SIZES = (1, 64, 256)
VARIANTS = ("torch", "kernel", "kernel32", "sampler")


def time_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def old_torch_sample(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The removed path: softmax of the scaled float32 copy, then the exponential race
    argmax(probs / E), E ~ Exp(1) (clamped so that 0/0 cannot make a NaN)."""
    probs = logits.to(torch.float32, copy=True).div_(temperature.unsqueeze(1)).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(torch.float32).tiny)
    return probs.div_(noise).argmax(dim=-1)


def variants(num_rows: int) -> dict[str, tuple[Callable[[], object], int]]:
    """variant -> (zero-argument call, bytes of logits it must read at least)."""
    logits = torch.randn(num_rows, VOCAB, device="cuda").mul_(3).bfloat16()
    logits32 = logits.float()
    temperature = torch.full((num_rows,), TEMPERATURE, device="cuda")
    seeds = torch.randint(0, 2**62, (num_rows,), device="cuda")
    rows = [SamplingRow(SamplingParams(temperature=TEMPERATURE), [], [])] * num_rows
    meta = SamplingMetadata.build(rows, VOCAB, "cuda")
    with use_triton_kernels(True):
        sampler = Sampler()
    n16, n32 = logits.numel() * logits.element_size(), logits32.numel() * logits32.element_size()
    return {
        "torch": (lambda: old_torch_sample(logits, temperature), n16),
        "kernel": (lambda: sampling.gumbel_max_sample(logits, seeds, temperature), n16),
        "kernel32": (lambda: sampling.gumbel_max_sample(logits32, seeds), n32),
        "sampler": (lambda: sampler(logits, meta), n16),
    }


def table(peak: float) -> None:
    print(f"\n{'B':>5}  " + "".join(f"{v + ' us':>13}" for v in VARIANTS)
          + "".join(f"{v + ' GB/s':>15}" for v in VARIANTS) + f"{'kernel % copy':>15}")
    for num_rows in SIZES:
        fns = variants(num_rows)
        times = {v: time_us(fn) for v, (fn, _) in fns.items()}
        gbs = {v: fns[v][1] / (t * 1e-6) / 1e9 for v, t in times.items()}
        print(f"{num_rows:>5}  " + "".join(f"{times[v]:13.1f}" for v in VARIANTS)
              + "".join(f"{gbs[v]:15.0f}" for v in VARIANTS)
              + f"{100 * gbs['kernel'] * 1e9 / peak:15.1f}", flush=True)


def sweep() -> None:
    """The kernels (bf16, with T) with other chunk sizes, warp counts and chunks a first-pass
    program (monkeypatched)."""
    print("\n== sweep (kernels only), do_bench us")
    original = sampling._CHUNK, sampling._NUM_WARPS, sampling._CHUNKS_PER_PROGRAM
    try:
        for num_rows in SIZES:
            fn, _ = variants(num_rows)["kernel"]
            for chunk in (1024, 2048, 4096, 8192):
                for warps in (4, 8):
                    for per_program in (1, 3, 5):
                        sampling._CHUNK, sampling._NUM_WARPS, sampling._CHUNKS_PER_PROGRAM = chunk, warps, per_program
                        print(f"   B={num_rows:4d} CHUNK={chunk:5d} warps={warps} chunks a program={per_program}: "
                              f"{time_us(fn):7.1f}", flush=True)
    finally:
        sampling._CHUNK, sampling._NUM_WARPS, sampling._CHUNKS_PER_PROGRAM = original


def main() -> None:
    args, peak = kernel_benchmark_args(__doc__, "also time other chunk sizes and warp counts")
    print(f"logits [B, {VOCAB}] bf16, temperature {TEMPERATURE}, every row random")
    with torch.inference_mode():
        table(peak)
        if args.sweep:
            sweep()


if __name__ == "__main__":
    main()
