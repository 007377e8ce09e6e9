"""Triton attention kernels against a naive float64 reference (tests/conftest.py).

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1,
small shapes, fp32/fp16: the interpreter mishandles bf16). With CUDA they run compiled,
and the `gpu`-marked tests add realistic shapes (`pytest -m gpu`).
"""

import random

import pytest
import torch
import triton

import minivllm.attention.triton_backend as triton_backend
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import store_kv
from minivllm.kernels import decode_attention, mixed_attention
from tests.conftest import ATTENTION_TOL, DEVICE, reference_attention


# ----------------------------------------------------------------------------------------
# Input builders (the reference, reference_attention, is in tests/conftest.py)
# ----------------------------------------------------------------------------------------
def make_batch(q_lens, seq_lens, block_size, share_blocks=0, extra_blocks=5, seed=0):
    """Block tables over a shuffled pool of blocks (so pages are never contiguous).

    share_blocks > 0: every sequence's first `share_blocks` blocks are sequence 0's (a
    shared prefix, as prefix caching produces). Returns tensors on DEVICE and num_blocks.
    """
    gen = random.Random(seed)
    need = [triton.cdiv(s, block_size) for s in seq_lens]
    max_blocks = max(need + [1]) + 2  # unused trailing entries stay 0
    num_blocks = sum(need) + extra_blocks
    pool = list(range(num_blocks))
    gen.shuffle(pool)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(need):
        for j in range(n):
            if b > 0 and j < share_blocks and j < need[0]:
                table[b, j] = table[0, j]
            else:
                table[b, j] = pool.pop()
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return (qsl.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            table.to(DEVICE), num_blocks)


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return k, v


def random_q(num_tokens, num_q_heads, head_dim, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_q_heads, head_dim, generator=g).to(dtype).to(DEVICE)


def check(out, ref, dtype):
    atol, rtol = ATTENTION_TOL[dtype]
    assert not torch.isnan(out).any(), "NaN in kernel output"
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def make_meta(qsl, seq_lens, block_tables, slot_mapping):
    """The batch's metadata; its leading one-token rows are its decodes, as the runner sets them."""
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    return AttentionMetadata(
        query_start_loc=qsl, seq_lens=seq_lens, block_tables=block_tables,
        slot_mapping=slot_mapping, max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()),
        num_leading_decodes=next((b for b, n in enumerate(q_lens) if n != 1), len(q_lens)),
        query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist())


# ----------------------------------------------------------------------------------------
# Mixed kernel (prefill chunks over cached prefixes + decode rows)
# ----------------------------------------------------------------------------------------
MIXED_CASES = {
    # name: (q_lens, seq_lens, share_blocks)
    "ragged_prefill": ([5, 33, 1, 70], [5, 33, 1, 70], 0),
    "chunks_with_prefix": ([17, 40, 3], [50, 130, 67], 0),
    "decode_and_chunks": ([1, 20, 1, 1, 9], [37, 60, 100, 1, 9], 0),
    "shared_prefix": ([7, 30, 1], [71, 94, 70], 4),
}


# Interpreter time is scarce: each head layout runs with one dtype (both dtypes and all
# GQA ratios are still covered, and every case meets every layout).
LAYOUTS = {  # name: (num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    "gqa1-d64-fp32": (2, 2, 64, 16, torch.float32),
    "gqa2-d128-fp16": (4, 2, 128, 8, torch.float16),
    "gqa4-d64-fp32": (8, 2, 64, 32, torch.float32),
    "gqa8-d128-fp16": (8, 1, 128, 16, torch.float16),
}


def check_mixed(case: str, layout: str, max_query_len: int | None = None) -> None:
    """The mixed kernel on a MIXED_CASES batch in a LAYOUTS layout, against the reference."""
    q_lens, seq_lens, share = MIXED_CASES[case]
    num_q_heads, num_kv_heads, head_dim, block_size, dtype = LAYOUTS[layout]
    qsl, lens, table, num_blocks = make_batch(q_lens, seq_lens, block_size, share)
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    q = random_q(sum(q_lens), num_q_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = mixed_attention.paged_attention_mixed(q, k_cache, v_cache, qsl, lens, table, scale,
                                                max_query_len=max_query_len)
    check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, scale), dtype)


@pytest.mark.parametrize("case", list(MIXED_CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed(case, layout):
    check_mixed(case, layout)


@pytest.mark.parametrize("case", list(MIXED_CASES))
def test_mixed_short_prompt_tiles(case):
    """The tiles mixed_config picks for short query chunks (fp16, D = 128), from max_query_len."""
    max_query_len = max(MIXED_CASES[case][0])
    assert (mixed_attention.mixed_config(128, torch.float16, 2, max_query_len)
            != mixed_attention.mixed_config(128, torch.float16, 2))
    check_mixed(case, "gqa2-d128-fp16", max_query_len)


@pytest.mark.parametrize("gqa", [3, 4])
def test_mixed_small_tiles(gqa):
    """Tiny tiles: many query tiles per sequence, keys split between the unmasked loop and
    the diagonal loop, BLOCK_N smaller than a page; a non-power-of-two GQA group (padded).
    Also first_seq: only the later sequences computed, earlier rows left untouched."""
    q_lens, seq_lens = [9, 1, 26, 4], [40, 23, 26, 77]
    block_size, num_kv_heads, head_dim, dtype = 32, 2, 64, torch.float32
    qsl, lens, table, num_blocks = make_batch(q_lens, seq_lens, block_size, share_blocks=1)
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    q = random_q(sum(q_lens), gqa * num_kv_heads, head_dim, dtype)
    gqa_pad = triton.next_power_of_2(gqa)
    config = mixed_attention.MixedConfig(block_q=16 // gqa_pad, block_n=16, num_warps=4, num_stages=2)
    ref = reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.3)
    out = mixed_attention.paged_attention_mixed(q, k_cache, v_cache, qsl, lens, table, 0.3, config=config)
    check(out, ref, dtype)
    out = torch.zeros_like(q)
    mixed_attention.paged_attention_mixed(q, k_cache, v_cache, qsl, lens, table, 0.3, out=out,
                                          config=config, first_seq=2, first_token=10)
    assert torch.equal(out[:10], torch.zeros_like(out[:10]))
    check(out[10:], ref[10:], dtype)


# ----------------------------------------------------------------------------------------
# Split-KV decode
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode(num_splits, layout):
    num_q_heads, num_kv_heads, head_dim, block_size, dtype = LAYOUTS[layout]
    # Ragged, including a long context (many tiles per split) and contexts shorter than
    # the split count (empty splits), over a shared prefix and shuffled pages.
    seq_lens = [1, 300, 17, 129]
    qsl, lens, table, num_blocks = make_batch([1] * len(seq_lens), seq_lens, block_size, share_blocks=1)
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    q = random_q(len(seq_lens), num_q_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = decode_attention.paged_attention_decode(q, k_cache, v_cache, lens, table, scale, num_splits)
    check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, scale), dtype)


def test_decode_gqa3_and_padded_rows():
    """A GQA group of 3 (padded inside the tile) and a padded row (seq_len 0 -> zeros)."""
    seq_lens = [90, 0, 33]
    qsl, lens, table, num_blocks = make_batch([1, 1, 1], seq_lens, 16)
    k_cache, v_cache = random_cache(num_blocks, 16, 2, 64, torch.float32)
    q = random_q(3, 6, 64, torch.float32)
    for num_splits in (1, 4):
        out = decode_attention.paged_attention_decode(q, k_cache, v_cache, lens, table, 0.125, num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.125), torch.float32)


def test_decode_short_tiles_for_big_batches_and_one_sequence():
    """16-bit caches take 64-key tiles with 2 warps from DECODE_SHORT_TILE_MIN_SEQS sequences
    and for a single one (128 keys, 4 warps between); the kernel with those tiles matches
    the reference."""
    big = decode_attention.DECODE_SHORT_TILE_MIN_SEQS
    for num_seqs in (2, big - 1):
        assert decode_attention.decode_config(128, torch.bfloat16, torch.bfloat16, num_seqs).tiles.block_n == 128
    config = decode_attention.decode_config(128, torch.float16, torch.float16, big)
    assert (config.tiles.block_n, config.tiles.num_warps) == (64, 2)
    assert decode_attention.decode_config(128, torch.bfloat16, torch.bfloat16, 1) == config
    seq_lens = [300, 1, 129]
    qsl, lens, table, num_blocks = make_batch([1] * len(seq_lens), seq_lens, 16)
    k_cache, v_cache = random_cache(num_blocks, 16, 2, 128, torch.float16)
    q = random_q(len(seq_lens), 4, 128, torch.float16)
    out = decode_attention.paged_attention_decode(q, k_cache, v_cache, lens, table, 0.1, 1, config=config)
    check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.1), torch.float16)


def test_decode_num_splits():
    # Big batches need no split; small batches with long contexts split up to the cap;
    # short contexts are not over-split.
    per_sm = decode_attention.DECODE_PROGRAMS_PER_SM
    assert decode_attention.decode_num_splits(256, 8, 4096, 132, per_sm) == 1
    assert decode_attention.decode_num_splits(1, 8, 4096, 132, per_sm) == decode_attention.DECODE_MAX_SPLITS
    assert decode_attention.decode_num_splits(1, 8, 100, 132, per_sm) == 1
    assert 1 < decode_attention.decode_num_splits(8, 8, 4096, 132, per_sm) < decode_attention.DECODE_MAX_SPLITS


def test_decode_num_splits_by_waves():
    # Contexts filling 1.2 waves (9 programs an SM on 132 SMs) are not split; below that a
    # launch aiming for 2.5 waves splits them into ~2.5 waves, where one wave needed none.
    per_sm, waves = 9, 2.5
    assert decode_attention.decode_num_splits(183, 8, 4096, 132, per_sm, waves=waves) == 1
    assert decode_attention.decode_num_splits(176, 8, 4096, 132, per_sm, waves=waves) == 3
    assert decode_attention.decode_num_splits(153, 8, 4096, 132, per_sm) == 1
    assert decode_attention.decode_num_splits(153, 8, 4096, 132, per_sm, waves=waves) == 3
    assert decode_attention.decode_num_splits(101, 8, 4096, 132, per_sm, waves=waves) == 4
    assert decode_attention.decode_num_splits(101, 8, 300, 132, per_sm, waves=waves) == 3  # 128-token splits
    # Contexts filling 0.25 to 0.65 of a wave aim for 1.6 waves where asked (fp8_decode's).
    few = dict(waves=waves, few_contexts=(0.25, 0.65), few_contexts_waves=1.6)
    assert decode_attention.decode_num_splits(64, 8, 4096, 132, per_sm, waves=waves) == 6
    assert decode_attention.decode_num_splits(64, 8, 4096, 132, per_sm, **few) == 4
    assert decode_attention.decode_num_splits(101, 8, 4096, 132, per_sm, **few) == 4  # 0.68 of a wave: 2.5
    assert decode_attention.decode_num_splits(24, 8, 4096, 132, per_sm, **few) == 16  # 0.16 of a wave: 2.5


def test_bad_head_dim_is_rejected():
    qsl, lens, table, num_blocks = make_batch([1], [5], 16)
    k_cache, v_cache = random_cache(num_blocks, 16, 1, 96, torch.float32)
    q = random_q(1, 1, 96, torch.float32)
    with pytest.raises(AssertionError, match="power of two"):
        mixed_attention.paged_attention_mixed(q, k_cache, v_cache, qsl, lens, table, 0.1)


# ----------------------------------------------------------------------------------------
# Backend: store then attend through AttentionMetadata
# ----------------------------------------------------------------------------------------
def run_backend_step(backend, q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                     dtype, share_blocks=0, max_seq_len=None):
    """Fill the cache for each sequence's cached prefix, then store the new tokens' K/V
    through the backend (slot_mapping with -1 for rows that must not be written) and attend."""
    qsl, lens, table, num_blocks = make_batch(q_lens, seq_lens, block_size, share_blocks)
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    num_tokens = sum(q_lens)
    new_k = random_q(num_tokens, num_kv_heads, head_dim, dtype, seed=3)
    new_v = random_q(num_tokens, num_kv_heads, head_dim, dtype, seed=4)
    slots, table_cpu = [], table.cpu()
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(table_cpu[b, pos // block_size]) * block_size + pos % block_size)
    # The first new token of sequence 0 is marked "already cached" (-1): the kernel must
    # skip it, so the reference sees the cache's old value there. Test batches may put new
    # tokens of two sequences into one shared block; only the first write of a slot is kept
    # (the engine never writes shared blocks, and two writes to one slot have no order).
    slots[0] = -1
    seen = set()
    for i, slot in enumerate(slots):
        if slot in seen:
            slots[i] = -1
        seen.add(slot)
    slots = torch.tensor(slots, dtype=torch.int64)
    keep = (slots >= 0).to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]] = new_k[keep]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]] = new_v[keep]
    meta = make_meta(qsl, lens, table, slots.to(DEVICE))
    if max_seq_len is not None:
        meta.max_seq_len = max_seq_len
    q = random_q(num_tokens, num_q_heads, head_dim, dtype)
    store_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    scale = head_dim ** -0.5
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    return out, reference_attention(q, expected_k, expected_v, qsl, lens, table, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_decode_and_mixed(dtype):
    backend = triton_backend.TritonAttentionBackend()
    # Decode-only step (split-KV path; the CPU stand-in has 4 "SMs", so this splits).
    out, ref = run_backend_step(backend, [1] * 4, [200, 5, 64, 33], 4, 2, 64, 16, dtype)
    check(out, ref, dtype)
    # Mixed step: leading decodes (-> decode kernel), a chunk over a cached prefix, a
    # one-token sequence after it (-> mixed kernel), a fresh prompt.
    out, ref = run_backend_step(backend, [1, 1, 24, 1, 10], [50, 120, 80, 7, 10], 4, 2, 64, 16, dtype,
                                share_blocks=2)
    check(out, ref, dtype)


# ----------------------------------------------------------------------------------------
# GPU: realistic shapes, compiled kernels (pytest -m gpu)
# ----------------------------------------------------------------------------------------
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_seqs", [1, 64, 256])
def test_gpu_decode_realistic(dtype, num_seqs):
    """1, 64 or 256 sequences (decode_config's tiles for one sequence, mid and big batches),
    contexts up to 4k, Qwen3-like heads (16 q / 8 kv, D 128)."""
    gen = random.Random(5)
    seq_lens = [gen.randint(1, 4096) for _ in range(num_seqs)]
    backend = triton_backend.TritonAttentionBackend(16, 8, 128, max_num_seqs=num_seqs)
    out, ref = run_backend_step(backend, [1] * num_seqs, seq_lens, 16, 8, 128, 16, dtype, share_blocks=8)
    check(out, ref, dtype)
    # Same step as a CUDA graph would see it: max_seq_len = max_model_len, more splits.
    out, ref = run_backend_step(backend, [1] * num_seqs, seq_lens, 16, 8, 128, 16, dtype, max_seq_len=8192)
    check(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_gpu_decode_small_batch_many_splits(dtype, gqa):
    seq_lens = [4000, 1, 1023, 2500]
    backend = triton_backend.TritonAttentionBackend()
    out, ref = run_backend_step(backend, [1] * 4, seq_lens, 8 * gqa // 2, 4, 128, 16, dtype)
    check(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32), (256, 16)])
def test_gpu_mixed_realistic(dtype, head_dim, block_size):
    """Chunked prefill beside 48 decodes (first, as the scheduler orders them: they take the
    decode kernel): a 2k chunk over a 1.5k cached prefix, fresh prompts, decode contexts up
    to 4k, sharing a prefix."""
    gen = random.Random(6)
    q_lens = [1] * 48 + [2048, 300, 77]
    seq_lens = [gen.randint(1, 4096) for _ in range(48)] + [3548, 300, 1077]
    out, ref = run_backend_step(triton_backend.TritonAttentionBackend(), q_lens, seq_lens, 16, 8,
                                head_dim, block_size, dtype, share_blocks=2)
    check(out, ref, dtype)


@pytest.mark.gpu
def test_gpu_mixed_prefill_first():
    """Prompt chunks before the decodes: everything goes through the mixed kernel."""
    gen = random.Random(7)
    q_lens = [2048, 300, 77] + [1] * 48
    seq_lens = [3548, 300, 1077] + [gen.randint(1, 4096) for _ in range(48)]
    out, ref = run_backend_step(triton_backend.TritonAttentionBackend(), q_lens, seq_lens, 16, 8,
                                128, 16, torch.bfloat16, share_blocks=2)
    check(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph():
    """Capture a decode step once, replay it with other lengths: same as eager."""
    num_seqs, hq, hkv, d, bs = 32, 16, 8, 128, 16
    dtype = torch.bfloat16
    max_model_len = 4096
    qsl, lens, table, num_blocks = make_batch([1] * num_seqs, [max_model_len] * num_seqs, bs)
    k_cache, v_cache = random_cache(num_blocks, bs, hkv, d, dtype)
    q = random_q(num_seqs, hq, d, dtype)
    backend = triton_backend.TritonAttentionBackend(hq, hkv, d, max_num_seqs=num_seqs)
    meta = make_meta(qsl, lens, table, torch.full((num_seqs,), -1, dtype=torch.int64, device=DEVICE))
    meta.max_seq_len = max_model_len
    backend.attend(q, k_cache, v_cache, meta, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(q, k_cache, v_cache, meta, 0.1)
    for trial in range(3):
        gen = random.Random(trial)
        lens.copy_(torch.tensor([gen.randint(0, max_model_len) for _ in range(num_seqs)]))
        q.copy_(random_q(num_seqs, hq, d, dtype, seed=trial))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.1), dtype)


def test_host_integer_helpers_match_tritons():
    """kernels.cdiv and kernels.next_power_of_2 (plain Python, for the host wrappers) give
    what triton.cdiv and triton.next_power_of_2 give, at a fraction of their call cost."""
    from minivllm.kernels.common import cdiv, next_power_of_2
    for n in range(5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
