"""Decode attention on W1's own batches (GPU only): the bandwidth the split-KV kernel reaches
step by step, and what W1's decode attention costs in all.

For every --every'th decode step t of W1 (BENCH.md's 256 requests), the batch is the requests
still decoding (max_tokens > t) in admission order, each with its prompt + t + 1 cached tokens,
padded to the CUDA-graph batch size the engine would replay (padded rows empty), with the
split count the engine's graph uses (max_seq_len = max_model_len = 4096). Qwen3-0.6B's
attention shape (16 query heads, 8 KV heads, head_dim 128, bf16, block size 16), pages
shuffled. Each timing runs enough layers' caches one after another that K/V come from HBM,
not L2, as in a step of 28 layers.

Variants: the engine's launch (the batch longest first, as the runner orders decodes: the GPU
starts programs roughly in launch order, so no long context starts last and sets the launch's
tail); the batch in admission order; (--sweep) half and twice the engine's split count, and
key tiles (BLOCK_N) of half and twice decode_config's; (--tiles) any tiles, each as
BLOCK_N/num_stages/num_warps, launched as the engine launches, or as
BLOCK_N/num_stages/num_warps/programs_per_sm with the split count that aims at that many
programs an SM (the engine aims at its decode_config's programs_per_sm). --kv-cache-dtype fp8: the cache
in float8 e4m3 (half the bytes; bandwidth is still bytes read / time). The summary ends with
each step's fastest launch (the admission order aside) and their total: what choosing tiles
by batch size (decode_config's num_seqs) could reach with these variants. Every launch's output
is checked against torch's attention over the same pages: a variant off by more than
MAX_ERROR is marked WRONG and never counts as a step's fastest.

    python -m benchmarks.kernels.decode_w1 [--every 32] [--sweep] [--kv-cache-dtype fp8] [--tiles 64/3/2 ...]
"""

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import replace

import torch
import triton
import triton.testing

from benchmarks.common import DEFAULT_MAX_MODEL_LEN, shuffled_block_tables, w1_requests
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend, to_cache_dtype
from minivllm.executor.cuda_graphs import graph_batch_sizes
from minivllm.kernels.common import sm_count
from minivllm.kernels.decode_attention import (
    DECODE_MAX_SPLITS,
    DECODE_PROGRAMS_PER_SM,
    DecodeConfig,
    DecodeTiles,
    decode_config,
    decode_num_splits,
    decode_num_splits_for,
    paged_attention_decode,
)

HQ, HKV, D, BLOCK = 16, 8, 128, 16
DTYPE = torch.bfloat16
MIN_BYTES_PER_TIMING = 256e6  # several times the 50 MB L2
MAX_NUM_SEQS = 256
MAX_ERROR = 0.05  # largest max_error a launch may show (right ones: ~0.01 on this data; a layout bug: ~1-100)


def w1_decode_batches(every: int) -> list[tuple[int, list[int]]]:
    """(step, context lengths in admission order) for every `every`th decode step of W1."""
    requests = w1_requests()
    longest = max(r.max_tokens for r in requests)
    return [(t, [len(r.prompt_token_ids) + t + 1 for r in requests if r.max_tokens > t])
            for t in range(0, longest, every)]


def kv_bytes(num_tokens: int, kv_dtype: torch.dtype) -> int:
    """One layer's K and V bytes for num_tokens cached tokens."""
    return num_tokens * HKV * D * 2 * kv_dtype.itemsize


def build_layers(seq_lens: list[int], gen: random.Random, kv_dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Enough layers' (k_cache, v_cache, block_tables) for the batch to total MIN_BYTES_PER_TIMING."""
    need = [triton.cdiv(s, BLOCK) for s in seq_lens]
    layers = []
    for _ in range(max(1, int(MIN_BYTES_PER_TIMING // kv_bytes(sum(seq_lens), kv_dtype)) + 1)):
        table = shuffled_block_tables(need, gen)
        k_cache, v_cache = (to_cache_dtype(torch.randn(sum(need), BLOCK, HKV, D, dtype=DTYPE, device="cuda"),
                                           kv_dtype) for _ in range(2))
        layers.append((k_cache, v_cache, table.cuda()))
    return layers


def max_error(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              table: torch.Tensor, lens: list[int]) -> float:
    """The largest |out - reference| / (|reference| + 0.01) over the batch's rows (padded rows,
    of length 0, come last and are left out): the reference is the torch backend's attention,
    in fp32, over the same pages (an FP8 cache's values as stored). Relative, as bf16 rounds
    each output to within 0.4 % of it."""
    lens = [n for n in lens if n > 0]
    rows = len(lens)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=q.device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=q.device), block_tables=table[:rows],
        slot_mapping=None, max_query_len=1, max_seq_len=max(lens), num_leading_decodes=rows,
        query_start_loc_cpu=list(range(rows + 1)), seq_lens_cpu=lens)
    want = TorchAttentionBackend().attend(q[:rows].float(), k_cache, v_cache, meta, D ** -0.5)
    return ((out[:rows].float() - want).abs() / (want.abs() + 0.01)).max().item()


def time_variant(seq_lens: list[int], padded: int, num_splits: int, gen: random.Random,
                 kv_dtype: torch.dtype, config: DecodeConfig | None) -> tuple[float, float]:
    """Seconds per layer of the decode launch (split kernel + reduce) over seq_lens padded
    with empty rows to `padded`, timed inside a CUDA graph, and the launch's max_error (so a
    tile variant's time never comes without a check of its output); config: decode_config's,
    if None."""
    lens = seq_lens + [0] * (padded - len(seq_lens))
    layers = build_layers([max(1, s) for s in lens], gen, kv_dtype)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(padded, HQ, D, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    part_out = torch.empty(padded * HQ * num_splits * D, dtype=torch.float32, device="cuda")
    part_lse = torch.empty(padded * HQ * num_splits, dtype=torch.float32, device="cuda")

    def step() -> None:
        for k_cache, v_cache, table in layers:
            paged_attention_decode(q, k_cache, v_cache, lens_dev, table, D ** -0.5, num_splits,
                                   out=out, part_out=part_out, part_lse=part_lse, config=config)
    step()
    error = max_error(q, out, *layers[-1], lens)  # out holds the last layer's result
    seconds = triton.testing.do_bench_cudagraph(step, rep=60, return_mode="median") * 1e-3 / len(layers)
    return seconds, error


# A variant: (context lengths in admission order, padded batch, engine split count) ->
# (lengths as launched, split count, tile config or None for decode_config's).
Variant = Callable[[list[int], int, int], tuple[list[int], int, DecodeConfig | None]]


def tile_variant(spec: str) -> Variant:
    """A --tiles entry, BLOCK_N/num_stages/num_warps[/programs per SM], as a launch longest
    first: the engine's split count, or the one that aims at that many programs an SM."""
    block_n, stages, warps, *programs_per_sm = (int(part) for part in spec.split("/"))
    # The launch reads only the tiles; the split target is the count chosen below.
    config = DecodeConfig(tiles=DecodeTiles(block_n=block_n, num_warps=warps, num_stages=stages),
                          programs_per_sm=programs_per_sm[0] if programs_per_sm else DECODE_PROGRAMS_PER_SM)
    sms = sm_count(torch.device("cuda"))

    def launch(lens: list[int], padded: int, splits: int) -> tuple[list[int], int, DecodeConfig]:
        if programs_per_sm:  # as the engine's graph, aimed at this tile's programs an SM
            splits = decode_num_splits(padded, HKV, DEFAULT_MAX_MODEL_LEN, sms, programs_per_sm[0])
        return sorted(lens, reverse=True), splits, config
    return launch


ADMISSION_ORDER = "admission order"  # the one variant that is not a launch the engine could choose


def variants(sweep: bool, kv_dtype: torch.dtype, tiles: list[str]) -> dict[str, Variant]:
    def longest_first(lens: list[int]) -> list[int]:
        return sorted(lens, reverse=True)
    chosen: dict[str, Variant] = {
        ADMISSION_ORDER: lambda lens, padded, splits: (lens, splits, None),
        "engine (longest first)": lambda lens, padded, splits: (longest_first(lens), splits, None),
    }
    if sweep:
        chosen["longest first, splits / 2"] = (
            lambda lens, padded, splits: (longest_first(lens), max(1, splits // 2), None))
        chosen["longest first, splits x 2"] = (
            lambda lens, padded, splits: (longest_first(lens), min(DECODE_MAX_SPLITS, splits * 2), None))
        for factor, label in ((2, "x 2"), (0.5, "/ 2")):
            def scaled_tiles(lens: list[int], padded: int, splits: int,
                             factor: float = factor) -> tuple[list[int], int, DecodeConfig]:
                engine_config = decode_config(D, DTYPE, kv_dtype, padded)
                tiles = replace(engine_config.tiles, block_n=int(engine_config.tiles.block_n * factor))
                return longest_first(lens), splits, replace(engine_config, tiles=tiles)
            chosen[f"longest first, BLOCK_N {label}"] = scaled_tiles
    for spec in tiles:
        chosen[f"tiles {spec}"] = tile_variant(spec)
    return chosen


def run(every: int, chosen: dict[str, Variant], kv_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    gen = random.Random(0)
    sms = sm_count(torch.device("cuda"))
    sizes = graph_batch_sizes(MAX_NUM_SEQS)
    kv_bytes_per_token = 28 * kv_bytes(1, kv_dtype)  # the whole model's K and V, per cached token
    totals = dict.fromkeys(chosen, 0.0)
    worst_error = dict.fromkeys(chosen, 0.0)
    best_total = 0.0  # each step at its fastest variant launched longest first: what a per-batch choice could reach
    winners: list[str] = []
    ideal = 0.0
    print(f"GPU: {torch.cuda.get_device_name()}; W1 decode steps every {every}; KV cache {kv_dtype}; "
          f"per-layer times, bandwidth = K+V bytes / time", flush=True)
    for step, seq_lens in w1_decode_batches(every):
        padded = next(s for s in sizes if s >= len(seq_lens))
        engine_cfg = decode_config(D, DTYPE, kv_dtype, padded)
        splits = decode_num_splits_for(engine_cfg, padded, HKV, DEFAULT_MAX_MODEL_LEN, sms)  # as the engine's graph
        layer_bytes = kv_bytes(sum(seq_lens), kv_dtype)
        cells = []
        times = {}
        right = set()  # the variants whose output passed max_error this step
        for name, variant in chosen.items():
            lens, num_splits, config = variant(seq_lens, padded, splits)
            seconds, error = time_variant(lens, padded, num_splits, gen, kv_dtype, config)
            times[name] = seconds
            totals[name] += seconds * 28 * every  # 28 layers; this step stands for `every` steps
            worst_error[name] = max(worst_error[name], error)
            if error <= MAX_ERROR:
                right.add(name)
            flag = "" if name in right else f" WRONG (max_error {error:.3g})"
            cells.append(f"{name} {seconds * 1e6:6.1f} us {layer_bytes / seconds / 1e12:4.2f} TB/s "
                         f"({num_splits}){flag}")
        fastest = min((name for name in right if name != ADMISSION_ORDER), key=times.__getitem__, default=None)
        if fastest is None:  # every launch wrong: the total below then leaves this step out
            winners.append(f"graph {padded:3d}: none right")
        else:
            best_total += times[fastest] * 28 * every
            winners.append(f"graph {padded:3d}: {fastest} ({times[fastest] * 1e6:.1f} us)")
        ideal += sum(seq_lens) * kv_bytes_per_token * every
        print(f"step {step:4d} batch {len(seq_lens):3d} (graph {padded:3d}) "
              f"ctx mean {sum(seq_lens) / len(seq_lens):5.0f} max {max(seq_lens):5d}: " + " | ".join(cells), flush=True)
    print(f"\nW1 decode attention, estimated from these steps (28 layers; BENCH.md's floor reads "
          f"{ideal / 1e12:.2f} TB, {ideal / 4.24e12:.2f} s at 4.24 TB/s):")
    for name, seconds in totals.items():
        print(f"  {name:32s} {seconds:6.3f} s  ({ideal / seconds / 1e12:.2f} TB/s; max_error {worst_error[name]:.2g})")
    print(f"  {'each step its fastest':32s} {best_total:6.3f} s  ({ideal / best_total / 1e12:.2f} TB/s): "
          + "; ".join(winners))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=32, help="time every this many'th decode step")
    parser.add_argument("--sweep", action="store_true",
                        help="also time half and twice the engine's split count and key tile")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="'fp8': the cache in float8 e4m3 ('auto': bf16, the queries' dtype)")
    parser.add_argument("--tiles", nargs="*", default=[], metavar="BLOCK_N/STAGES/WARPS[/PROGRAMS_PER_SM]",
                        help="also time these decode tiles, longest first, with the engine's split counts "
                             "or those that aim at PROGRAMS_PER_SM programs an SM")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_w1.py needs a CUDA GPU")
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else DTYPE
    run(args.every, variants(args.sweep, kv_dtype, args.tiles), kv_dtype)


if __name__ == "__main__":
    main()
