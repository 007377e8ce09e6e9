"""Would two micro-batches on two streams hide a decode step's matmuls under its attention?
(GPU only; a probe for a design question, not a benchmark of the engine.)

A W1 decode step is ~75 % attention, which streams K/V at the HBM rate, and ~25 % small
matmuls and elementwise kernels, which are latency-bound and leave HBM mostly idle. Split
the batch in two halves A and B, one CUDA stream each: while A's attention streams, B's
o-projection, MLP and next qkv could run beside it.

This builds Qwen3-0.6B's 28 decode layers out of the engine's kernels (RMSNorm, the qkv / o /
gate_up / down matmuls, SiLU-and-mul, split-KV decode attention over a paged cache of W1's
contexts at one step; RoPE and the K/V store left out) and times one forward, in a CUDA graph:

* one batch, one stream (as the engine runs today);
* two halves on two streams, free-running (the graph's two branches start together);
* two halves on two streams, attention alternating: B's attention at layer l waits for A's,
  A's at l + 1 for B's, so one half's matmuls run while the other half's attention streams.

    python benchmarks/overlap_probe.py [--step 320]
"""

import argparse
import random
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, uninstalled
from benchmarks.common import shuffled_block_tables  # noqa: E402
from benchmarks.decode_w1 import w1_decode_batches  # noqa: E402
from minivllm.executor.cuda_graphs import graph_batch_sizes  # noqa: E402
from minivllm.kernels import paged_attention as pa  # noqa: E402
from minivllm.kernels import sm_count  # noqa: E402
from minivllm.kernels.fused_ops import add_rms_norm, rms_norm, silu_and_mul  # noqa: E402

LAYERS, HIDDEN, INTER, HQ, HKV, D, BLOCK = 28, 1024, 3072, 16, 8, 128, 16
DTYPE = torch.bfloat16
EPS = 1e-6


class Half:
    """A (micro-)batch's decode inputs: its sequences' lengths and block tables, per-layer
    caches, hidden states and split-KV workspace."""

    def __init__(self, seq_lens: list[int], block_tables: torch.Tensor, k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor]) -> None:
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.block_tables = block_tables
        self.k_caches, self.v_caches = k_caches, v_caches
        padded = len(seq_lens)
        self.x = torch.randn(padded, HIDDEN, dtype=DTYPE, device="cuda")
        self.splits = pa.decode_num_splits(padded, HKV, 4096, sm_count(torch.device("cuda")))
        rows = padded * HQ * self.splits
        self.part_out = torch.empty(rows * D, dtype=torch.float32, device="cuda")
        self.part_lse = torch.empty(rows, dtype=torch.float32, device="cuda")

    @classmethod
    def build(cls, seq_lens: list[int], padded: int, gen: random.Random) -> "Half":
        """seq_lens padded with empty rows to `padded`, over fresh caches with shuffled pages."""
        lens = seq_lens + [0] * (padded - len(seq_lens))
        need = [triton.cdiv(max(1, s), BLOCK) for s in lens]
        table = shuffled_block_tables(need, gen)
        k_caches = [torch.randn(sum(need), BLOCK, HKV, D, dtype=DTYPE, device="cuda") for _ in range(LAYERS)]
        return cls(lens, table.cuda(), k_caches, [torch.randn_like(k) for k in k_caches])

    def rows(self, index: list[int], padded: int) -> "Half":
        """These rows of the batch (the same caches), padded with empty rows to `padded`."""
        lens = self.seq_lens.tolist()
        tables = torch.zeros(padded, self.block_tables.shape[1], dtype=torch.int32, device="cuda")
        tables[:len(index)] = self.block_tables[index]
        return Half([lens[i] for i in index] + [0] * (padded - len(index)), tables, self.k_caches, self.v_caches)


def layer_parts(weights: dict[str, list[torch.Tensor]], half: Half, layer: int, state: dict):
    """The layer as three callables: pre-attention (norm, qkv), attention, post (o, MLP)."""
    def pre() -> None:
        if layer == 0:
            state["residual"] = half.x.clone()
            state["h"] = rms_norm(half.x, weights["norm1"][0], EPS)
        qkv = state["h"] @ weights["qkv"][layer]
        state["q"] = qkv[:, :HQ * D].view(-1, HQ, D)

    def attend() -> None:
        state["attn"] = pa.paged_attention_decode(
            state["q"], half.k_caches[layer], half.v_caches[layer], half.seq_lens, half.block_tables,
            D ** -0.5, half.splits, part_out=half.part_out, part_lse=half.part_lse)

    def post() -> None:
        o = state["attn"].view(-1, HQ * D) @ weights["o"][layer]
        h, residual = add_rms_norm(o, state["residual"], weights["norm2"][layer], EPS)
        down = silu_and_mul(h @ weights["gate_up"][layer]) @ weights["down"][layer]
        state["h"], state["residual"] = add_rms_norm(down, residual, weights["norm1"][layer], EPS)
    return pre, attend, post


def forward_one_stream(weights, half: Half) -> None:
    state: dict = {}
    for layer in range(LAYERS):
        for part in layer_parts(weights, half, layer, state):
            part()


def forward_two_streams(weights, halves: list[Half], streams: list[torch.cuda.Stream], alternate: bool) -> None:
    """Each half's layers on its own stream; with `alternate`, the attentions take turns."""
    main = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(main)
    states: list[dict] = [{}, {}]
    parts = [[layer_parts(weights, half, layer, states[i]) for layer in range(LAYERS)] for i, half in enumerate(halves)]
    last_attention: torch.cuda.Event | None = None
    for layer in range(LAYERS):
        for i in range(2):
            pre, attend, post = parts[i][layer]
            with torch.cuda.stream(streams[i]):
                pre()
                if alternate and last_attention is not None:
                    streams[i].wait_event(last_attention)
                attend()
                if alternate:
                    last_attention = torch.cuda.Event()
                    last_attention.record(streams[i])
                post()
    for stream in streams:
        main.wait_stream(stream)


def probe_step(step: int, seq_lens: list[int], weights: dict[str, list[torch.Tensor]],
               streams: list[torch.cuda.Stream], gen: random.Random) -> None:
    """Time the three ways of running one forward over this W1 step's batch."""
    sizes = graph_batch_sizes(256)
    seq_lens = sorted(seq_lens, reverse=True)
    padded = next(s for s in sizes if s >= len(seq_lens))
    whole = Half.build(seq_lens, padded, gen)
    # Interleaved halves (longest first in each) so both carry about the same K/V.
    half_padded = next(s for s in sizes if s >= (len(seq_lens) + 1) // 2)
    halves = [whole.rows(list(range(i, len(seq_lens), 2)), half_padded) for i in range(2)]
    kv_bytes = sum(seq_lens) * HKV * D * 2 * 2 * LAYERS
    q = torch.zeros(padded, HQ, D, dtype=DTYPE, device="cuda")

    def attention_only() -> None:
        for k_cache, v_cache in zip(whole.k_caches, whole.v_caches):
            pa.paged_attention_decode(q, k_cache, v_cache, whole.seq_lens, whole.block_tables, D ** -0.5,
                                      whole.splits, part_out=whole.part_out, part_lse=whole.part_lse)
    us = 1e3 * triton.testing.do_bench_cudagraph(attention_only, rep=200, return_mode="median")
    print(f"step {step}: batch {len(seq_lens)} (graph {padded}, halves {half_padded}), ctx mean "
          f"{sum(seq_lens) / len(seq_lens):.0f}; K/V {kv_bytes / 1e9:.2f} GB; attention alone "
          f"{us:.0f} us ({kv_bytes / us / 1e6:.2f} TB/s)", flush=True)
    runs = {"one stream": lambda: forward_one_stream(weights, whole),
            "two streams, free": lambda: forward_two_streams(weights, halves, streams, False),
            "two streams, alternating": lambda: forward_two_streams(weights, halves, streams, True)}
    for name, run in runs.items():
        us = 1e3 * triton.testing.do_bench_cudagraph(run, rep=200, return_mode="median")
        print(f"   {name:26s} {us:7.0f} us per forward", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", type=int, nargs="+", default=[64, 320, 640], help="W1 decode steps to take the batch of")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("overlap_probe.py needs a CUDA GPU")
    torch.manual_seed(0)
    gen = random.Random(0)

    def weight(rows: int, cols: int) -> list[torch.Tensor]:
        return [torch.randn(rows, cols, dtype=DTYPE, device="cuda") * rows ** -0.5 for _ in range(LAYERS)]
    weights = {"qkv": weight(HIDDEN, (HQ + 2 * HKV) * D), "o": weight(HQ * D, HIDDEN),
               "gate_up": weight(HIDDEN, 2 * INTER), "down": weight(INTER, HIDDEN),
               "norm1": [torch.ones(HIDDEN, dtype=DTYPE, device="cuda")] * LAYERS,
               "norm2": [torch.ones(HIDDEN, dtype=DTYPE, device="cuda")] * LAYERS}
    batches = dict(w1_decode_batches(1))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for step in args.step:
        probe_step(step, batches[step], weights, streams, gen)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
