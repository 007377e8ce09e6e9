"""Cascade (shared-prefix) decode attention against the plain split-KV decode kernel (GPU only).

    python -m benchmarks.kernels.cascade_attention            # the backend's heuristic split counts
    python -m benchmarks.kernels.cascade_attention --sweep    # also each launch alone, other tiles / split counts

W3's decode step (BENCH.md), one layer: Qwen3-0.6B heads (16 query, 8 KV, head_dim 128,
bf16, block size 16), 256 sequences whose block tables all start with the same 128 blocks
(a 2,048-token prefix) followed by 64..192 own tokens each, pages shuffled.

Reported: median time in a CUDA graph (triton.testing.do_bench_cudagraph, as the engine replays it),
and bytes / time for both. Bytes are what each kernel must move from HBM: the plain kernel
reads every sequence's whole context (the prefix 256 times); the cascade reads the prefix
once (its other row tiles hit L2), the suffixes once, and writes + reads its fp32 partials.
"""

import functools
import random

import torch
import triton
import triton.testing

from benchmarks.common import kernel_benchmark_args
from benchmarks.kernels.attention_kernels import BLOCK, DTYPE, HKV, HQ, PEAK_BW, D
from minivllm.kernels.cascade_attention import (
    OwnKeysConfig,
    SharedPrefixConfig,
    launch_own_keys,
    paged_attention_decode_shared_prefix,
    shared_prefix_config,
    shared_prefix_num_splits,
)
from minivllm.kernels.common import sm_count
from minivllm.kernels.decode_attention import (
    DECODE_PROGRAMS_PER_SM,
    DECODE_SHARED_PREFIX,
    DecodeTiles,
    decode_config,
    decode_num_splits,
    launch_decode_split,
    paged_attention_decode,
)

NUM_SEQS = 256
PREFIX_LEN = 2048


def build_w3(seed: int = 0):
    """Cache, block tables (shared prefix first), seq_lens and the prefix length in blocks."""
    gen = random.Random(seed)
    suffix = [gen.randint(64, 192) for _ in range(NUM_SEQS)]
    num_prefix_blocks = PREFIX_LEN // BLOCK
    own = [triton.cdiv(PREFIX_LEN + s, BLOCK) - num_prefix_blocks for s in suffix]
    num_blocks = num_prefix_blocks + sum(own)
    perm = list(range(num_blocks))
    gen.shuffle(perm)
    prefix, rest = perm[:num_prefix_blocks], perm[num_prefix_blocks:]
    table = torch.zeros(NUM_SEQS, num_prefix_blocks + max(own), dtype=torch.int32)
    i = 0
    for b, n in enumerate(own):
        table[b, :num_prefix_blocks + n] = torch.tensor(prefix + rest[i:i + n])
        i += n
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, dtype=DTYPE, device="cuda")
    v_cache = torch.randn_like(k_cache)
    seq_lens = [PREFIX_LEN + s for s in suffix]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    num_prefix_blocks = torch.tensor([num_prefix_blocks], dtype=torch.int32, device="cuda")
    return k_cache, v_cache, lens, table.cuda(), num_prefix_blocks, seq_lens


def graphed_s(fn) -> float:
    """Median seconds of fn replayed in a CUDA graph, as the engine runs it (eager launch
    overhead would hide a kernel this short)."""
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


# Own-keys (suffix) launch tiles tried by --sweep: (HEADS, BLOCK_N, num_warps, num_stages),
# KV heads per program x tokens per key tile. W3's own contexts are 64..192 tokens.
SUFFIX_TILES = [(4, 16, 4, 3), (4, 16, 4, 2), (8, 16, 4, 3), (8, 8, 4, 3), (2, 32, 4, 2), (4, 32, 4, 3),
                (1, 32, 4, 2), (1, 64, 4, 3), (4, 16, 8, 3)]


def main() -> None:
    args, _ = kernel_benchmark_args(__doc__, "also time other prefix tiles and split counts")
    k_cache, v_cache, lens, table, num_prefix_blocks, seq_lens = build_w3()
    q = torch.randn(NUM_SEQS, HQ, D, dtype=DTYPE, device="cuda")
    scale = D ** -0.5
    sms = sm_count(torch.device("cuda", 0))
    token_bytes = HKV * D * 2 * k_cache.element_size()  # K and V of one token, all KV heads
    suffix_tokens = sum(seq_lens) - NUM_SEQS * PREFIX_LEN
    print(f"\n== W3 decode step, one layer: {NUM_SEQS} seqs, {PREFIX_LEN} shared + "
          f"{suffix_tokens / NUM_SEQS:.0f} own tokens (mean); Hq {HQ}, Hkv {HKV}, D {D}, {DTYPE}")

    # Plain split-KV decode: every sequence reads its whole context.
    splits = decode_num_splits(NUM_SEQS, HKV, max(seq_lens), sms,
                               decode_config(D, DTYPE, k_cache.dtype, NUM_SEQS).programs_per_sm)
    plain_out = torch.empty_like(q)
    plain = functools.partial(paged_attention_decode, q, k_cache, v_cache, lens, table, scale, splits, out=plain_out)
    plain()
    plain_bytes = sum(seq_lens) * token_bytes
    t = graphed_s(plain)
    print(f"   plain   (splits {splits}): {t * 1e6:8.1f} us, {plain_bytes / 1e6:7.1f} MB -> "
          f"{plain_bytes / t / 1e12:5.2f} TB/s ({100 * plain_bytes / t / PEAK_BW:5.1f}% of 4.24)",
          flush=True)

    # Cascade: split counts as TritonAttentionBackend picks them, then the sweep's.
    rows = NUM_SEQS * (HQ // HKV)
    default_cfg = shared_prefix_config(D, DTYPE, k_cache.dtype, rows)
    suffix_splits = decode_num_splits(NUM_SEQS, HKV, max(seq_lens) - PREFIX_LEN, sms, DECODE_PROGRAMS_PER_SM)
    prefix_splits = shared_prefix_num_splits(
        triton.cdiv(rows, default_cfg.block_m), HKV, PREFIX_LEN, sms)
    variants = [(default_cfg, prefix_splits, suffix_splits, "default")]
    if args.sweep:
        sweep_launches(q, k_cache, v_cache, lens, table, num_prefix_blocks, scale, default_cfg,
                       prefix_splits, suffix_tokens * token_bytes)
        for bm, bn, w, s in [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                             (64, 128, 8, 2), (256, 64, 8, 2)]:
            for ps in [1, 2, 4, 8, 16]:
                cfg = SharedPrefixConfig(block_m=bm, tiles=DecodeTiles(block_n=bn, num_warps=w, num_stages=s))
                variants.append((cfg, ps, suffix_splits, ""))
    max_parts = max(ps + ss for _, ps, ss, _ in variants)
    part_out = torch.empty(NUM_SEQS * HQ * max_parts * D, dtype=torch.float32, device="cuda")
    part_lse = torch.empty(NUM_SEQS * HQ * max_parts, dtype=torch.float32, device="cuda")
    for cfg, ps, ss, tag in variants:
        out = torch.empty_like(q)
        def fn(cfg=cfg, ps=ps, ss=ss, out=out):  # bound now: do_bench calls it in this iteration
            paged_attention_decode_shared_prefix(
                q, k_cache, v_cache, lens, table, num_prefix_blocks, scale, prefix_splits=ps,
                suffix_splits=ss, out=out, part_out=part_out, part_lse=part_lse, prefix_config=cfg)
        try:
            fn()
        except triton.runtime.errors.OutOfResources as e:  # e.g. too much shared memory
            print(f"   cascade {cfg}: skipped ({e})")
            continue
        diff = (out.float() - plain_out.float()).abs().max().item()
        assert diff < 3e-2, f"cascade disagrees with plain decode (max |diff| {diff})"
        # fp32 partials: each part written once and read once by the merge.
        partial_bytes = 2 * NUM_SEQS * HQ * (ps + ss) * (D + 1) * 4
        cascade_bytes = (PREFIX_LEN + suffix_tokens) * token_bytes + partial_bytes
        t = graphed_s(fn)
        print(f"   cascade BLOCK_M {cfg.block_m:3d} BLOCK_N {cfg.tiles.block_n:3d} warps "
              f"{cfg.tiles.num_warps} stages {cfg.tiles.num_stages} splits {ps:2d}+{ss}: {t * 1e6:8.1f} us, "
              f"{cascade_bytes / 1e6:6.1f} MB -> {cascade_bytes / t / 1e12:5.2f} TB/s "
              f"(max |diff| vs plain {diff:.3g}) {tag}", flush=True)


def sweep_launches(q, k_cache, v_cache, lens, table, num_prefix_blocks, scale, prefix_cfg,
                   prefix_splits: int, suffix_bytes: int) -> None:
    """Each launch of the cascade alone, in a CUDA graph: the prefix launch (default tiles),
    then the own-keys launch, one split (it merges the prefix parts itself), over
    SUFFIX_TILES; with the whole cascade (all launches) graphed for each."""
    parts = prefix_splits + 1
    part_out = torch.empty(NUM_SEQS * HQ * parts * D, dtype=torch.float32, device="cuda")
    part_lse = torch.empty(NUM_SEQS * HQ * parts, dtype=torch.float32, device="cuda")
    out = torch.empty_like(q)

    t = graphed_s(lambda: launch_decode_split(
        q, k_cache, v_cache, out, part_out, part_lse, lens, table, DECODE_SHARED_PREFIX,
        num_prefix_blocks, scale, prefix_splits, 0, parts, prefix_cfg.block_m, prefix_cfg.tiles))
    print(f"   prefix launch alone (graphed, BLOCK_M {prefix_cfg.block_m} BLOCK_N {prefix_cfg.tiles.block_n}, "
          f"splits {prefix_splits}): {t * 1e6:7.1f} us", flush=True)
    for heads, block_n, warps, stages in SUFFIX_TILES:
        cfg = OwnKeysConfig(heads=heads, block_n=block_n, num_warps=warps, num_stages=stages)
        t = graphed_s(lambda cfg=cfg: launch_own_keys(
            q, k_cache, v_cache, out, part_out, part_lse, lens, table, num_prefix_blocks, scale, 1,
            prefix_splits, parts, cfg))
        whole = graphed_s(lambda cfg=cfg: paged_attention_decode_shared_prefix(
            q, k_cache, v_cache, lens, table, num_prefix_blocks, scale, prefix_splits=prefix_splits,
            suffix_splits=1, out=out, part_out=part_out, part_lse=part_lse, prefix_config=prefix_cfg,
            suffix_config=cfg))
        print(f"   own-keys launch alone HEADS {heads} BLOCK_N {block_n:3d} warps {warps} stages {stages}: "
              f"{t * 1e6:7.1f} us "
              f"({suffix_bytes / t / 1e12:4.2f} TB/s of own K/V); whole cascade graphed {whole * 1e6:7.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
