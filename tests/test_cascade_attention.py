"""Cascade (shared-prefix) decode attention against a naive float64 reference.

Every sequence's block table starts with the same blocks (the shared prefix); the cascade
reads them once per tile of queries, then each sequence's own keys, and merges the two.
Without CUDA the kernels run in Triton's interpreter (small shapes, fp32/fp16); the
`gpu`-marked tests use W3's shapes (256 sequences over a 2,048-token prefix, bf16).
"""

import random
from dataclasses import replace

import pytest
import torch
import triton

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.triton_backend import TritonAttentionBackend
from minivllm.kernels import cascade_attention, decode_attention
from tests.conftest import ATTENTION_TOL, DEVICE, reference_attention


class CascadeBatch:
    """A decode batch over a shuffled page pool: `num_prefix_blocks` shared pages first in
    every block table, then each sequence's own pages (suffix_lens[b] tokens)."""

    def __init__(self, suffix_lens: list[int], num_prefix_blocks: int, block_size: int,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 seed: int = 0) -> None:
        gen = random.Random(seed)
        prefix_len = num_prefix_blocks * block_size
        self.seq_lens_cpu = [prefix_len + s for s in suffix_lens]
        own = [triton.cdiv(s, block_size) for s in self.seq_lens_cpu]
        own = [n - num_prefix_blocks for n in own]
        num_blocks = num_prefix_blocks + sum(own) + 3  # a few never-used pages
        pool = list(range(num_blocks))
        gen.shuffle(pool)
        prefix = [pool.pop() for _ in range(num_prefix_blocks)]
        width = num_prefix_blocks + max(own) + 2  # trailing entries stay 0
        table = torch.zeros(len(suffix_lens), width, dtype=torch.int32)
        for b, n in enumerate(own):
            table[b, :num_prefix_blocks + n] = torch.tensor(prefix + [pool.pop() for _ in range(n)])
        g = torch.Generator().manual_seed(seed + 1)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        self.v_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        self.q = torch.randn(len(suffix_lens), num_q_heads, head_dim, generator=g).to(dtype).to(DEVICE)
        self.block_tables = table.to(DEVICE)
        self.num_prefix_blocks = torch.tensor([num_prefix_blocks], dtype=torch.int32, device=DEVICE)
        self.seq_lens = torch.tensor(self.seq_lens_cpu, dtype=torch.int32, device=DEVICE)
        self.scale = head_dim ** -0.5
        self.dtype = dtype

    def meta(self) -> AttentionMetadata:
        """The decode-only step's metadata, with the shared prefix set for the cascade."""
        num_seqs = len(self.seq_lens_cpu)
        return AttentionMetadata(
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE),
            seq_lens=self.seq_lens, block_tables=self.block_tables,
            slot_mapping=torch.full((num_seqs,), -1, dtype=torch.int64, device=DEVICE),
            max_query_len=1, max_seq_len=max(self.seq_lens_cpu), num_leading_decodes=num_seqs,
            num_shared_prefix_blocks=self.num_prefix_blocks)

    def cascade(self, **kwargs) -> torch.Tensor:
        return cascade_attention.paged_attention_decode_shared_prefix(
            self.q, self.k_cache, self.v_cache, self.seq_lens, self.block_tables,
            self.num_prefix_blocks, self.scale, **kwargs)

    def plain(self, num_splits: int = 1, config: decode_attention.DecodeConfig | None = None) -> torch.Tensor:
        return decode_attention.paged_attention_decode(self.q, self.k_cache, self.v_cache, self.seq_lens,
                                                       self.block_tables, self.scale, num_splits, config=config)

    def reference(self) -> torch.Tensor:
        """Per sequence: its one query over all its keys, in float64."""
        query_start_loc = torch.arange(len(self.seq_lens_cpu) + 1, device=DEVICE)
        return reference_attention(self.q, self.k_cache, self.v_cache, query_start_loc,
                                   self.seq_lens, self.block_tables, self.scale)

    def check(self, out: torch.Tensor) -> None:
        atol, rtol = ATTENTION_TOL[self.dtype]
        assert out.dtype == self.dtype and not torch.isnan(out).any()
        torch.testing.assert_close(out.double(), self.reference(), atol=atol, rtol=rtol)


# Head layouts, each with one dtype (interpreter time is scarce); all GQA 1/2/4/8, head_dim
# 64/128, block sizes 8/16 and both dtypes are covered.
LAYOUTS = {  # name: (block_size, num_q_heads, num_kv_heads, head_dim, dtype)
    "gqa1-d64-bs8-fp32": (8, 2, 2, 64, torch.float32),
    "gqa2-d128-bs16-fp16": (16, 4, 2, 128, torch.float16),
    "gqa4-d64-bs16-fp16": (16, 8, 2, 64, torch.float16),
    "gqa8-d128-bs8-fp32": (8, 8, 1, 128, torch.float32),
    "gqa2-hkv4-d64-bs8-fp32": (8, 8, 4, 64, torch.float32),  # own-keys programs of 4 KV heads
}
CASES = {  # name: (suffix_lens, num_prefix_blocks, prefix_splits, suffix_splits)
    # One prefix block, every sequence with only its new token (suffix of exactly 1).
    "one_block_suffix1": ([1, 1, 1], 1, 1, 1),
    # Several blocks, ragged suffixes (1, within one page, across pages), split both ways
    # (more prefix splits than tiles: some splits are empty).
    "ragged_split": ([1, 17, 40, 3, 70], 5, 3, 2),
    # The same with one suffix split: the suffix launch merges the prefix parts itself.
    "ragged_suffix_merges": ([1, 17, 40, 3, 70], 5, 3, 1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cascade_matches_reference(case, layout):
    suffix_lens, prefix_blocks, prefix_splits, suffix_splits = CASES[case]
    batch = CascadeBatch(suffix_lens, prefix_blocks, *LAYOUTS[layout])
    batch.check(batch.cascade(prefix_splits=prefix_splits, suffix_splits=suffix_splits))


@pytest.mark.parametrize("num_kv_heads,heads", [(1, 1), (2, 2), (3, 1), (4, 4), (6, 2), (8, 4), (12, 4)])
def test_own_keys_heads_per_program_divide_the_kv_heads(num_kv_heads, heads):
    cfg = cascade_attention.own_keys_config(128, torch.bfloat16, num_kv_heads)
    assert cfg.heads == heads
    assert cfg.heads * cfg.block_n == 64  # key rows per tile: 16 KB of bf16 keys at D=128


@pytest.mark.parametrize("cache_dtype,block_n,stages", [(torch.bfloat16, 64, 3), (torch.float8_e4m3fn, 128, 2)])
def test_shared_prefix_tiles_follow_the_cache_dtype(cache_dtype, block_n, stages):
    # W3's step: 512 (sequence, head) rows per KV head. 16-bit caches take 64-key tiles in
    # three stages; FP8 caches keep the mixed kernel's 128 keys in two (measured faster there).
    cfg = cascade_attention.shared_prefix_config(128, torch.bfloat16, cache_dtype, 512)
    assert (cfg.block_m, cfg.tiles.block_n, cfg.tiles.num_stages) == (128, block_n, stages)
    # Rows cut to a power of two:
    assert cascade_attention.shared_prefix_config(128, torch.bfloat16, cache_dtype, 40).block_m == 64


def test_cascade_small_row_tiles():
    """BLOCK_M 16 over 6 sequences x GQA 4 = 24 rows: two row tiles, the second partly
    padding; BLOCK_N 16 over a 40-token prefix: a ragged last prefix tile."""
    batch = CascadeBatch([1, 9, 2, 30, 8, 1], 5, 8, 8, 2, 64, torch.float32, seed=3)
    cfg = cascade_attention.SharedPrefixConfig(
        block_m=16, tiles=decode_attention.DecodeTiles(block_n=16, num_warps=4, num_stages=2))
    batch.check(batch.cascade(prefix_splits=2, prefix_config=cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cascade_equals_plain_decode(dtype):
    """Same batch through the plain split-KV kernel and through the cascade: the same
    attention, summed in another order, so equal to fp32 rounding."""
    batch = CascadeBatch([1, 33, 12, 64], 4, 16, 4, 2, 64, dtype, seed=5)
    plain = batch.plain(num_splits=2)
    cascade = batch.cascade(prefix_splits=2, suffix_splits=1)
    atol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16: one output rounding apart
    torch.testing.assert_close(cascade.float(), plain.float(), atol=atol, rtol=1e-3)


@pytest.mark.parametrize("suffix_splits,reduce_launches", [(1, 0), (2, 1)])
def test_reduce_launch_only_for_a_split_suffix(monkeypatch, suffix_splits, reduce_launches):
    """With one split per own-keys context the suffix launch merges the prefix's parts (no
    reduce launch); with more, the reduce merges them."""
    batch = CascadeBatch([1, 17, 40], 3, 16, 4, 2, 64, torch.float32, seed=9)
    launches = []
    real = cascade_attention.launch_decode_reduce
    monkeypatch.setattr(cascade_attention, "launch_decode_reduce", lambda *a: launches.append(a) or real(*a))
    batch.check(batch.cascade(prefix_splits=2, suffix_splits=suffix_splits))
    assert len(launches) == reduce_launches


@pytest.mark.parametrize("num_row_tiles", [1, 2, 3, 4, 33, 200])
@pytest.mark.parametrize("prefix_len", [16, 300, 2048, 1 << 20])
def test_prefix_splits_stay_within_one_wave(num_row_tiles, prefix_len):
    """The prefix launch runs one program per SM: its split count never makes a second
    wave (unless one split per tile already does), nor more splits than the prefix has
    PREFIX_MIN_TOKENS_PER_SPLIT-token pieces (rounded up)."""
    num_sms, num_kv_heads = 132, 8
    splits = cascade_attention.shared_prefix_num_splits(num_row_tiles, num_kv_heads, prefix_len, num_sms)
    programs_per_split = num_row_tiles * num_kv_heads
    pieces = -(-prefix_len // cascade_attention.PREFIX_MIN_TOKENS_PER_SPLIT)
    assert 1 <= splits <= min(pieces, decode_attention.DECODE_MAX_SPLITS)
    assert splits == 1 or splits * programs_per_split <= num_sms
    # The most that fits: one more split would break one of the bounds.
    more = splits + 1
    assert more * programs_per_split > num_sms or more > pieces or more > decode_attention.DECODE_MAX_SPLITS


def test_reduce_over_more_parts_than_one_step():
    """31 prefix + 4 suffix splits: 35 parts per row, more than the reduce loads at once
    (PARTS_PER_STEP 32). The prefix fills only its first splits, the 200-token suffix all
    four of its own (parts 31-34): keys on both sides of the step boundary, so the running
    maximum has to carry across it."""
    batch = CascadeBatch([1, 200, 3], 4, 16, 4, 2, 64, torch.float32, seed=13)
    batch.check(batch.cascade(prefix_splits=31, suffix_splits=4))


def test_empty_prefix_is_plain_decode():
    """With no shared prefix the cascade is the own-keys launch alone: the plain decode's
    result, exactly, over key tiles as wide as the own-keys launch's (one KV head here)."""
    batch = CascadeBatch([5, 20], 0, 8, 2, 1, 64, torch.float32)
    own_keys_tile = cascade_attention.own_keys_config(64, torch.float32, 1).block_n
    plain_config = decode_attention.decode_config(64, torch.float32, torch.float32, 2)
    plain_config = replace(plain_config, tiles=replace(plain_config.tiles, block_n=own_keys_tile))
    assert torch.equal(batch.cascade(suffix_splits=2), batch.plain(num_splits=2, config=plain_config))


def test_backend_takes_cascade_path(monkeypatch):
    """attend() sends a decode-only step with meta.num_shared_prefix_blocks to the cascade
    (and without it, to the plain kernel)."""
    batch = CascadeBatch([1, 30, 7, 50], 3, 16, 4, 2, 64, torch.float16, seed=7)
    meta = batch.meta()
    calls = []
    real = cascade_attention.paged_attention_decode_shared_prefix
    monkeypatch.setattr("minivllm.attention.triton_backend.paged_attention_decode_shared_prefix",
                        lambda *a, **k: calls.append(k) or real(*a, **k))
    backend = TritonAttentionBackend()
    batch.check(backend.attend(batch.q, batch.k_cache, batch.v_cache, meta, batch.scale))
    assert len(calls) == 1
    meta.num_shared_prefix_blocks = None
    batch.check(backend.attend(batch.q, batch.k_cache, batch.v_cache, meta, batch.scale))
    assert len(calls) == 1


# ----------------------------------------------------------------------------------------
# GPU: W3's shapes, compiled kernels (pytest -m gpu)
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_cascade_w3(dtype):
    """256 sequences, a 2,048-token shared prefix plus 64..192 own tokens, Qwen3-0.6B heads,
    through the backend (heuristic split counts) and against the plain decode kernel."""
    gen = random.Random(11)
    suffix = [gen.randint(64, 192) for _ in range(255)] + [1]
    batch = CascadeBatch(suffix, 2048 // 16, 16, 16, 8, 128, dtype, seed=11)
    out = TritonAttentionBackend(16, 8, 128, max_num_seqs=256).attend(
        batch.q, batch.k_cache, batch.v_cache, batch.meta(), batch.scale)
    batch.check(out)
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out.float(), batch.plain().float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16), (256, 16), (128, 8)])
def test_gpu_cascade_layouts(gqa, head_dim, block_size):
    """bf16, every GQA ratio and head size, several splits both ways."""
    gen = random.Random(gqa * head_dim + block_size)
    suffix = [gen.randint(1, 300) for _ in range(37)]
    batch = CascadeBatch(suffix, 1024 // block_size, block_size, 4 * gqa, 4, head_dim,
                         torch.bfloat16, seed=gqa)
    for prefix_splits, suffix_splits in [(1, 1), (4, 3)]:
        batch.check(batch.cascade(prefix_splits=prefix_splits, suffix_splits=suffix_splits))


def test_warm_up_runs_every_row_tile_size_and_leaves_the_cache_alone(monkeypatch) -> None:
    """The start-up warm-up launches the cascade once per BLOCK_M a batch can use."""
    tile_sizes: list[int] = []
    launch = cascade_attention.launch_decode_split

    def spy(*args, **kwargs) -> None:
        if args[8] == decode_attention.DECODE_SHARED_PREFIX:  # mode
            tile_sizes.append(args[-2])  # block_m
        launch(*args, **kwargs)

    monkeypatch.setattr(cascade_attention, "launch_decode_split", spy)
    batch = CascadeBatch([1], 1, 8, 4, 2, 32, torch.float32)
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    # GQA 2: up to 40 rows per KV head -> tiles of 16, 32 and 64 rows.
    TritonAttentionBackend().warm_up_shared_prefix((4, 32), torch.float32, batch.k_cache, batch.v_cache, 20)
    assert sorted(tile_sizes) == [16, 32, 64]
    assert torch.equal(batch.k_cache, k_before) and torch.equal(batch.v_cache, v_before)
