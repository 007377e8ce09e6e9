"""W1's decode steps as the engine runs them: the engine's captured CUDA graph of each step's
batch size, replayed over W1's batch at that step (GPU only).

For every --every'th decode step t of W1 (BENCH.md's 256 requests), the decode graph of the
batch size the runner would pad to is replayed (median of triton.testing.do_bench) over the
requests still decoding (max_tokens > t), longest first as the runner orders decodes, each with
its prompt + t + 1 cached tokens on shuffled pages (the cache's contents are whatever the engine left there; nothing is
stored: the slot mapping is -1). Prints ms a step: the whole forward of every layer, as in W1's
decode steps, without the sampling and the host's work around it. Unlike decode_w1.py (one
attention launch at a time) this sees what the launches around the attention and PDL make of it.

--splits N captures the graphs with N splits in every decode attention launch instead of
decode_attention.decode_num_splits_for's count: how that heuristic is tuned.

    python -m benchmarks.kernels.decode_graphs --kv-cache-dtype fp8 [--every 50] [--splits 3]
"""

import argparse
import functools
import random

import torch
import triton.testing

from benchmarks.common import add_common_args, make_llm, resolve_model, shuffled_block_tables
from benchmarks.kernels.decode_w1 import w1_decode_batches
from minivllm.kernels.common import cdiv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--every", type=int, default=50, help="time every this many'th decode step of W1")
    parser.add_argument("--splits", type=int, default=None, help="force this split count in every decode launch")
    args = parser.parse_args()
    if args.splits is not None:
        from minivllm.attention import triton_backend

        triton_backend.decode_num_splits_for = lambda *_, **__: args.splits
    llm, _ = make_llm(args, resolve_model(args.model), max_num_seqs=256)
    runner = llm.llm_engine.model_runner
    graphs = runner.graphs
    assert graphs is not None, "decode_graphs times the engine's CUDA graphs: run without --enforce-eager"
    buffers = graphs.buffers.device
    gen = random.Random(0)
    total_ms = 0.0
    print(f"GPU: {torch.cuda.get_device_name()}; KV cache {args.kv_cache_dtype or 'auto'}; "
          f"splits {args.splits or 'decode_num_splits_for'}; median ms a step", flush=True)
    with torch.inference_mode():
        for step, seq_lens in w1_decode_batches(args.every):
            seq_lens = sorted(seq_lens, reverse=True)
            num_seqs = len(seq_lens)
            size = next(s for s in graphs.decode_sizes if s >= num_seqs)
            blocks = [cdiv(n, runner.block_size) for n in seq_lens]
            assert sum(blocks) <= runner.num_blocks, "the KV cache cannot hold this batch"
            table = shuffled_block_tables(blocks, gen)
            for tensor in (buffers.block_tables, buffers.seq_lens, buffers.positions):
                tensor.zero_()
            buffers.block_tables[:num_seqs, :table.shape[1]] = table.to(buffers.block_tables.device)
            lens = torch.tensor(seq_lens, device=buffers.seq_lens.device)
            buffers.seq_lens[:num_seqs] = lens
            buffers.positions[:num_seqs] = lens - 1
            buffers.input_ids[:size] = torch.randint(0, 1000, (size,), device=buffers.input_ids.device)
            buffers.slot_mapping.fill_(-1)
            ms = triton.testing.do_bench(functools.partial(graphs.replay, (size, size), "decode"), warmup=25, rep=100,
                                         return_mode="median")
            total_ms += ms
            print(f"step {step:4d}: {num_seqs:3d} sequences (graph {size:3d}), context mean "
                  f"{sum(seq_lens) / num_seqs:5.0f} max {seq_lens[0]:5d}: {ms:.3f} ms", flush=True)
    print(f"sum {total_ms:.3f} ms")


if __name__ == "__main__":
    main()
