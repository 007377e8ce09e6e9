"""Microbenchmark of the Triton paged-attention kernels (GPU only).

    python -m benchmarks.kernels.attention_kernels            # the configured kernels
    python -m benchmarks.kernels.attention_kernels --sweep    # also try other tile configs / splits

Shapes are Qwen3-0.6B's (16 query heads, 8 KV heads, head_dim 128, bf16, block size 16),
pages shuffled across the cache as after a long serving run.

* Decode (split-KV kernel + reduce): batch 256 with contexts ~1000 (uniform 800..1200) and
  batch 1 with context 1024. Reported: median time (triton.testing.do_bench, which includes
  launch gaps; and do_bench_cudagraph, the kernel time a captured graph sees) and achieved
  bandwidth = bytes of K and V that must be read / time, against 4.24 TB/s (BENCH.md's
  measured device copy; this script also times a torch copy, for reference only: its
  first version, a uint8 copy, read 2.78 TB/s, well below BENCH.md's figure).
* A chunked-prefill step (255 decodes + one 2048-token chunk): the backend's split
  (decodes -> decode kernel) against the mixed kernel doing everything.
* Mixed kernel, in TFLOP/s (4 * Hq * D * visible (query, key) pairs): one 8192-token prompt
  (causal, no cached prefix; beside torch SDPA on the same contiguous K/V), W2's 1024-token
  prompt, and a W1 prompt step (8192 tokens of whole prompts of W1's lengths, 100-1024).
"""

import functools
import random

import torch
import triton
import triton.testing

from benchmarks.common import kernel_benchmark_args, shuffled_block_tables, w1_requests
from minivllm.kernels.common import sm_count
from minivllm.kernels.decode_attention import (
    DECODE_PROGRAMS_PER_SM,
    DecodeConfig,
    DecodeTiles,
    decode_config,
    decode_num_splits_for,
    paged_attention_decode,
)
from minivllm.kernels.mixed_attention import MixedConfig, mixed_config, paged_attention_mixed

HQ, HKV, D, BLOCK = 16, 8, 128, 16
DTYPE = torch.bfloat16
PEAK_BW = 4.24e12  # bytes/s, BENCH.md


def build(seq_lens, seed=0):
    """Cache with exactly enough (shuffled) blocks for the batch, plus its block tables."""
    need = [triton.cdiv(s, BLOCK) for s in seq_lens]
    table = shuffled_block_tables(need, random.Random(seed))
    k_cache = torch.randn(sum(need), BLOCK, HKV, D, dtype=DTYPE, device="cuda")
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, lens, table.cuda()


def time_fn(fn):
    eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return eager * 1e-3, graph * 1e-3  # seconds


def bench_decode(name, seq_lens, sweep):
    k_cache, v_cache, lens, table = build(seq_lens)
    batch = len(seq_lens)
    q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda")
    kv_bytes = sum(seq_lens) * HKV * D * 2 * k_cache.element_size()  # K and V, every head
    sms = sm_count(torch.device("cuda", 0))
    default_cfg = decode_config(D, DTYPE, DTYPE, batch)
    default_splits = decode_num_splits_for(default_cfg, batch, HKV, max(seq_lens), sms)
    graph_splits = decode_num_splits_for(default_cfg, batch, HKV, 4096, sms)  # as captured: max_model_len
    print(f"\n== decode {name}: batch {batch}, context total {sum(seq_lens)} "
          f"(mean {sum(seq_lens) / batch:.0f}), K+V bytes {kv_bytes / 1e6:.1f} MB", flush=True)
    print(f"   heuristic splits: {default_splits} (max_seq_len = batch max), "
          f"{graph_splits} (max_seq_len = 4096); config {default_cfg}")
    variants = [(default_cfg, default_splits, "default")]
    if graph_splits != default_splits:
        variants.append((default_cfg, graph_splits, "default, graph splits"))
    if sweep:
        if batch >= 64:
            configs = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 4, 5), (32, 4, 3), (32, 4, 5),
                       (128, 4, 3), (128, 8, 3), (128, 8, 4), (64, 8, 3), (32, 2, 4)]
            splits = [1, 2]
        else:  # a small batch: many short splits (up to 64 with 16-key tiles) against fewer long ones
            configs = [(64, 4, 3), (32, 4, 3), (32, 4, 5), (16, 4, 3), (32, 2, 3), (128, 8, 3)]
            splits = [4, 8, 16, 32, 64]
        for bn, w, s in configs:
            config = DecodeConfig(tiles=DecodeTiles(block_n=bn, num_warps=w, num_stages=s),
                                  programs_per_sm=DECODE_PROGRAMS_PER_SM)
            for ns in splits:
                variants.append((config, ns, ""))
    ref = None
    # Split-KV workspace, preallocated as the backend does (sized for the most splits).
    max_rows = batch * HQ * max(ns for _, ns, _ in variants)
    part_out = torch.empty(max_rows * D, dtype=torch.float32, device="cuda")
    part_lse = torch.empty(max_rows, dtype=torch.float32, device="cuda")
    for cfg, ns, tag in variants:
        out = torch.empty_like(q)
        fn = functools.partial(paged_attention_decode, q, k_cache, v_cache, lens, table, D ** -0.5, ns, out=out,
                               part_out=part_out, part_lse=part_lse, config=cfg)
        fn()
        if ref is None:
            ref = out.clone()
        else:
            assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2), "variant disagrees"
        t_eager, t_graph = time_fn(fn)
        print(f"   BLOCK_N {cfg.tiles.block_n:3d} warps {cfg.tiles.num_warps} stages {cfg.tiles.num_stages} "
              f"splits {ns:2d}: {t_eager * 1e6:8.1f} us eager ({kv_bytes / t_eager / 1e12:5.2f} TB/s), "
              f"{t_graph * 1e6:8.1f} us graph ({kv_bytes / t_graph / 1e12:5.2f} TB/s, "
              f"{100 * kv_bytes / t_graph / PEAK_BW:5.1f}% of 4.24) {tag}", flush=True)


def bench_mixed(name, prompt_lens, sweep, sdpa=False):
    """The mixed kernel over whole prompts (no cached prefix) of these lengths, in one launch."""
    k_cache, v_cache, lens, table = build(prompt_lens)
    starts = [0]
    for n in prompt_lens:
        starts.append(starts[-1] + n)
    n = starts[-1]
    q = torch.randn(n, HQ, D, dtype=DTYPE, device="cuda")
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    flops = sum(4 * HQ * D * (p * (p + 1) // 2) for p in prompt_lens)
    print(f"\n== mixed kernel: {name}, causal ({flops / 1e9:.0f} GFLOP)", flush=True)
    default_cfg = mixed_config(D, DTYPE, HQ // HKV)
    variants = [default_cfg]
    if sweep:
        for bq, bn, w, s in [(64, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3),
                             (64, 32, 8, 4), (32, 128, 8, 2), (32, 64, 4, 2), (16, 64, 4, 3)]:
            variants.append(MixedConfig(block_q=bq, block_n=bn, num_warps=w, num_stages=s))
    ref = None
    for cfg in variants:
        fn = functools.partial(paged_attention_mixed, q, k_cache, v_cache, qsl, lens, table, D ** -0.5, config=cfg)
        out = fn()
        if ref is None:
            ref = out.clone()
        else:
            assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2), "variant disagrees"
        t, t_graph = time_fn(fn)
        print(f"   {cfg}: {t * 1e6:8.1f} us eager, {t_graph * 1e6:8.1f} us graph, "
              f"{flops / t_graph / 1e12:6.1f} TFLOP/s (graph)", flush=True)
    if not sdpa:
        return
    # Reference point: SDPA (FlashAttention) on the same keys laid out contiguously (one prompt).
    assert len(prompt_lens) == 1, "the SDPA reference is for one prompt"
    blocks = table[0, : triton.cdiv(n, BLOCK)].long()
    # KV heads repeated for the GQA groups, so that the FlashAttention backend is eligible.
    k = k_cache[blocks].reshape(-1, HKV, D)[:n].repeat_interleave(HQ // HKV, 1).transpose(0, 1)[None].contiguous()
    v = v_cache[blocks].reshape(-1, HKV, D)[:n].repeat_interleave(HQ // HKV, 1).transpose(0, 1)[None].contiguous()
    qq = q.transpose(0, 1)[None].contiguous()
    sdpa_fn = functools.partial(torch.nn.functional.scaled_dot_product_attention, qq, k, v, is_causal=True,
                                scale=D ** -0.5)
    diff = (sdpa_fn()[0].transpose(0, 1).float() - ref.float()).abs().max().item()
    t, _ = time_fn(sdpa_fn)
    print(f"   torch SDPA (contiguous K/V): {t * 1e3:7.3f} ms, {flops / t / 1e12:6.1f} TFLOP/s "
          f"(max |diff| vs ours {diff:.3g})", flush=True)


def w1_prompt_step(budget: int = 8192) -> list[int]:
    """Whole W1 prompts (BENCH.md's lengths, in order) while they fit in one step's budget."""
    lens = []
    for r in w1_requests():
        if sum(lens) + len(r.prompt_token_ids) > budget:
            break
        lens.append(len(r.prompt_token_ids))
    return lens


def bench_mixed_step():
    """A chunked-prefill step: 255 decodes (contexts ~1000) first, then a 2048-token chunk over
    a 2048-token cached prefix. The backend sends the decodes to the decode kernel; compare
    with the mixed kernel doing everything."""
    from minivllm.attention.metadata import AttentionMetadata
    from minivllm.attention.triton_backend import TritonAttentionBackend

    gen = random.Random(1)
    q_lens = [1] * 255 + [2048]
    seq_lens = [gen.randint(800, 1200) for _ in range(255)] + [4096]
    k_cache, v_cache, lens, table = build(seq_lens)
    qsl_cpu = [0]
    for n in q_lens:
        qsl_cpu.append(qsl_cpu[-1] + n)
    qsl = torch.tensor(qsl_cpu, dtype=torch.int32, device="cuda")
    q = torch.randn(qsl_cpu[-1], HQ, D, dtype=DTYPE, device="cuda")
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=lens, block_tables=table, slot_mapping=None,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_leading_decodes=q_lens.count(1),
        query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens)
    backend = TritonAttentionBackend(HQ, HKV, D, 256)
    print("\n== mixed step: 255 decodes (ctx ~1000) + a 2048-token chunk over a 2048 prefix", flush=True)
    split = backend.attend(q, k_cache, v_cache, meta, D ** -0.5)
    whole = paged_attention_mixed(q, k_cache, v_cache, qsl, lens, table, D ** -0.5)
    diff = (split.float() - whole.float()).abs().max().item()
    t_split, _ = time_fn(lambda: backend.attend(q, k_cache, v_cache, meta, D ** -0.5))
    t_whole, _ = time_fn(lambda: paged_attention_mixed(q, k_cache, v_cache, qsl, lens, table, D ** -0.5))
    print(f"   backend (decodes -> decode kernel): {t_split * 1e6:8.1f} us; "
          f"mixed kernel for all: {t_whole * 1e6:8.1f} us (max |diff| {diff:.3g})", flush=True)


def main():
    args, _ = kernel_benchmark_args(__doc__, "also time other tile configs and split counts")
    gen = random.Random(0)
    bench_decode("batch 256, ctx ~1000", [gen.randint(800, 1200) for _ in range(256)], args.sweep)
    bench_decode("batch 1, ctx 1024", [1024], args.sweep)
    bench_mixed("one 8192-token prompt", [8192], args.sweep, sdpa=True)
    bench_mixed("W2's 1024-token prompt", [1024], args.sweep)
    w1_lens = w1_prompt_step()
    bench_mixed(f"a W1 prompt step ({len(w1_lens)} prompts, {sum(w1_lens)} tokens)", w1_lens, args.sweep)
    bench_mixed_step()


if __name__ == "__main__":
    main()
