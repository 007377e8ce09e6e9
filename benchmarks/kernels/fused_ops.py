"""Microbenchmark of the small per-token ops: torch eager vs torch.compile vs Triton (GPU only).

    python -m benchmarks.kernels.fused_ops            # the table (< 1 min including compiles)
    python -m benchmarks.kernels.fused_ops --sweep    # also try other launch configs of the Triton kernels

Shapes are Qwen3-0.6B's (hidden 1024, intermediate 3072, 16 query heads, 8 KV heads,
head_dim 128), bf16, for N = 1, 64, 256, 2048, 8192 tokens. Ops:

* rms_norm      RMSNorm(x)                       (the first layer's input norm, q/k norms)
* add_rms_norm  RMSNorm(x, residual)             (every other norm of a decoder layer)
* qk_rope_store per-head RMSNorm of q and k, RotaryEmbedding, K/V into the paged cache
                (Qwen3's attention inputs; one Triton kernel, q rotated in place)
* silu_and_mul  SiluAndMul(gate_up)

Variants: (1) eager = minivllm/layers' torch code, (2) compile = torch.compile(dynamic=False,
default mode) of that same code, (3) triton = minivllm/kernels/fused_ops.py. Times are
medians in microseconds: triton.testing.do_bench (each call launched from Python, L2
flushed between calls) and, in brackets for N <= 256, do_bench_cudagraph (the call
captured in a CUDA graph, as a decode step replays it: no launch overhead, warm L2).
GB/s counts the bytes an op must move (each input read once, each output written once)
over the do_bench time. The last lines sum one decoder layer's share
(2 add_rms_norm + qk_rope_store + silu_and_mul) at N=256. First, the launch floor: what a
kernel that does nothing costs in a chain of dependent kernels in a CUDA graph.
"""

import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing
from transformers import PretrainedConfig

from benchmarks.common import kernel_benchmark_args
from minivllm.kernels import fused_ops
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding

H, INTER, HQ, HKV, D, MAX_POS, EPS = 1024, 3072, 16, 8, 128, 40960, 1e-6
DTYPE = torch.bfloat16
SIZES = (1, 64, 256, 2048, 8192)
OPS = ("rms_norm", "add_rms_norm", "qk_rope_store", "silu_and_mul")
VARIANTS = ("eager", "compile", "triton")
GRAPH_MAX_N = 256  # larger N: no CUDA-graph column (those steps are not captured)
LAYER_OPS = {"add_rms_norm": 2, "qk_rope_store": 1, "silu_and_mul": 1}  # per decoder layer
BLOCK_SIZE = 16


def time_us(fn: Callable[[], object], graph: bool = True) -> tuple[float, float]:
    """(do_bench median, do_bench_cudagraph median or nan), microseconds.

    Short reps keep the whole script under a minute: do_bench_cudagraph captures rep / (time
    per call) calls, thousands of nodes for a launch-bound eager op, and graph building is
    the slow part.
    """
    eager = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
    replay = float("nan")
    if graph:
        try:
            replay = triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")
        except Exception:  # noqa: BLE001 (a variant that cannot be captured: NaN, rather than abort the table)
            pass
    return eager * 1e3, replay * 1e3


class Layer:
    """The torch modules, with Qwen3-0.6B shapes and random bf16 weights."""

    def __init__(self) -> None:
        self.norm = RMSNorm(H, EPS).to("cuda", DTYPE)
        self.norm.weight.copy_(1 + 0.1 * torch.randn(H))
        self.head_norm = RMSNorm(D, EPS).to("cuda", DTYPE)
        self.rope = RotaryEmbedding(PretrainedConfig(rope_theta=1e6), D, MAX_POS).cuda()
        self.act = SiluAndMul()
        # One compiled callable per op; dynamic=False recompiles it for each N.
        self.compiled = {
            "rms_norm": torch.compile(lambda x: self.norm(x), dynamic=False),
            "add_rms_norm": torch.compile(lambda x, r: self.norm(x, r), dynamic=False),
            "qk_rope_store": torch.compile(self.qk_rope_store, dynamic=False),
            "silu_and_mul": torch.compile(lambda x: self.act(x), dynamic=False),
        }

    def qk_rope_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The torch layers' way: q/k norms, RoPE, then K and V written into the cache."""
        q, k = self.rope(positions, self.head_norm(q), self.head_norm(k))
        k_cache.view(-1, HKV, D)[slots] = k
        v_cache.view(-1, HKV, D)[slots] = v
        return q

    def ops(self, n: int) -> dict[str, tuple[dict[str, Callable[[], object]], int]]:
        """op -> ({variant: zero-argument call}, bytes the op must move)."""
        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, dtype=DTYPE, device="cuda")

        x, residual, gate_up = rnd(n, H), rnd(n, H), rnd(n, 2 * INTER)
        q, k, v = rnd(n, HQ, D), rnd(n, HKV, D), rnd(n, HKV, D)
        positions = torch.randint(0, MAX_POS, (n,), device="cuda")
        k_cache, v_cache = (rnd(n // BLOCK_SIZE + 1, BLOCK_SIZE, HKV, D) for _ in range(2))
        slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device="cuda")[:n]
        cache_args = (positions, q, k, v, k_cache, v_cache, slots)
        hw = self.head_norm.weight
        w, c, e = self.norm.weight, self.compiled, DTYPE.itemsize
        return {
            "rms_norm": ({
                "eager": lambda: self.norm(x),
                "compile": lambda: c["rms_norm"](x),
                "triton": lambda: fused_ops.rms_norm(x, w, EPS),
            }, 2 * n * H * e),
            "add_rms_norm": ({
                "eager": lambda: self.norm(x, residual),
                "compile": lambda: c["add_rms_norm"](x, residual),
                # In place into `residual`: it drifts over the repetitions, harmlessly.
                "triton": lambda: fused_ops.add_rms_norm(x, residual, w, EPS),
            }, 4 * n * H * e),
            "qk_rope_store": ({
                "eager": lambda: self.qk_rope_store(*cache_args),
                "compile": lambda: c["qk_rope_store"](*cache_args),
                "triton": lambda: fused_ops.qk_norm_rope_store(
                    positions, q, k, v, self.rope.cos_sin, k_cache, v_cache, slots, hw, hw, EPS),
            # Bytes: q in+out, k/v in+out; cos/sin; positions, slots.
            }, n * (2 * HQ + 4 * HKV) * D * e + n * (2 * D * 4 + 16)),
            "silu_and_mul": ({
                "eager": lambda: self.act(gate_up),
                "compile": lambda: c["silu_and_mul"](gate_up),
                "triton": lambda: fused_ops.silu_and_mul(gate_up),
            }, 3 * n * INTER * e),
        }


def table(layer: Layer, peak: float) -> None:
    print(f"\n{'op':<14}{'N':>6}  " + "".join(f"{v + ' us':>20}" for v in VARIANTS)
          + f"{'GB/s e/c/t':>19}{'t % copy':>9}")
    per_layer = {v: [0.0, 0.0] for v in VARIANTS}
    compile_s = 0.0
    for op in OPS:
        for n in SIZES:
            fns, nbytes = layer.ops(n)[op]
            t0 = time.perf_counter()
            try:
                fns["compile"]()  # compile outside the timing
            except Exception as exc:  # noqa: BLE001 (report and go on: the other variants still mean something)
                print(f"   torch.compile failed for {op} N={n}: {type(exc).__name__}: {exc}"[:300])
                fns["compile"] = lambda: None
            torch.cuda.synchronize()
            compile_s += time.perf_counter() - t0
            # Graphs matter for decode steps (small N) only; mixed/prefill steps run eagerly.
            times = {v: time_us(fns[v], graph=n <= GRAPH_MAX_N) for v in VARIANTS}
            if n == 256 and op in LAYER_OPS:
                for v in VARIANTS:
                    per_layer[v][0] += LAYER_OPS[op] * times[v][0]
                    per_layer[v][1] += LAYER_OPS[op] * times[v][1]
            gbs = {v: nbytes / (t * 1e-6) / 1e9 for v, (t, _) in times.items()}
            cells = "".join(f"{t:9.1f} [{g:7.1f}] " if g == g else f"{t:9.1f} {'':9} "
                            for t, g in times.values())
            print(f"{op:<14}{n:>6}  {cells}{'/'.join(f'{b:.0f}' for b in gbs.values()):>19}"
                  f"{100 * gbs['triton'] * 1e9 / peak:>9.1f}", flush=True)
    print(f"\n(torch.compile took {compile_s:.1f} s over all shapes)")
    print("per decoder layer at N=256 (2 add_rms_norm + qk_rope_store + silu_and_mul), us [graph]:")
    for v, (t, g) in per_layer.items():
        print(f"   {v:<8}{t:8.1f} [{g:7.1f}]")


def sweep(layer: Layer) -> None:
    """The Triton variant under other launch configs (monkeypatched heuristics)."""
    print("\n== sweep (triton only), do_bench us [graph]")
    originals = (fused_ops._norm_launch_config, fused_ops._qk_num_warps, fused_ops._silu_launch_config)
    try:
        for n in (256, 8192):
            ops = layer.ops(n)
            for block_m in (1, 2, 4):
                for warps in (2, 4, 8):
                    fused_ops._norm_launch_config = lambda h, rows, m=block_m, w=warps: (
                        m, triton.next_power_of_2(h), w)
                    t, g = time_us(ops["add_rms_norm"][0]["triton"], graph=n <= GRAPH_MAX_N)
                    print(f"   add_rms_norm N={n:5d} BLOCK_M={block_m} warps={warps}: {t:7.1f} [{g:7.1f}]")
            fused_ops._norm_launch_config = originals[0]
            for warps in (1, 2, 4, 8):
                fused_ops._qk_num_warps = lambda bh, d, w=warps: w
                t, g = time_us(ops["qk_rope_store"][0]["triton"], graph=n <= GRAPH_MAX_N)
                print(f"   qk_rope_store N={n:5d} warps={warps}: {t:7.1f} [{g:7.1f}]")
            fused_ops._qk_num_warps = originals[1]
            for block in (512, 1024, 2048):
                for warps in (2, 4, 8):
                    fused_ops._silu_launch_config = lambda i, b=block, w=warps: (b, w)
                    t, g = time_us(ops["silu_and_mul"][0]["triton"], graph=n <= GRAPH_MAX_N)
                    print(f"   silu_and_mul N={n:5d} BLOCK={block} warps={warps}: {t:7.1f} [{g:7.1f}]")
            fused_ops._silu_launch_config = originals[2]
    finally:
        fused_ops._norm_launch_config, fused_ops._qk_num_warps, fused_ops._silu_launch_config = originals


@triton.jit
def _one_element_kernel(x_ptr, USE_GDC: tl.constexpr):
    if USE_GDC:  # programmatic dependent launch: wait here for the kernel before to finish
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def launch_floor() -> None:
    """What any kernel costs in a decode step's graph, however little it does: a chain of
    dependent one-element kernels (each reads what the one before wrote); and the same
    launched with programmatic dependent launch (Hopper: a kernel starts while the one
    before drains and waits at gdc_wait), the way to hide boundaries if steps owned their
    kernels (cuBLAS's are launched without it)."""
    x = torch.zeros(1, device="cuda")
    for pdl, chain in ((False, 1), (False, 100), (True, 100)):
        def run(chain: int = chain, pdl: bool = pdl) -> None:
            for _ in range(chain):
                _one_element_kernel[(1,)](x, USE_GDC=pdl, launch_pdl=pdl)
        try:
            run()
            us = triton.testing.do_bench_cudagraph(run, rep=20, return_mode="median") * 1e3 / chain
        except Exception as exc:  # noqa: BLE001 (PDL unsupported here: say so, keep the rest of the table)
            print(f"launch floor with PDL={pdl}: failed ({type(exc).__name__}: {exc})"[:300])
            continue
        print(f"launch floor: a one-element Triton kernel in a CUDA graph, chain of {chain}"
              f"{', programmatic dependent launch' if pdl else ''}: {us:.2f} us each")


def main() -> None:
    args, peak = kernel_benchmark_args(__doc__, "also time other launch configs")
    print(f"Qwen3-0.6B shapes: H={H}, I={INTER}, Hq={HQ}, Hkv={HKV}, D={D}, {DTYPE}")
    launch_floor()
    with torch.inference_mode():
        layer = Layer()
        table(layer, peak)
        if args.sweep:
            sweep(layer)


if __name__ == "__main__":
    main()
