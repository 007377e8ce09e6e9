"""Cascade decode attention over the paged KV cache, in Triton: `paged_attention_decode_shared_prefix`.

For decode batches whose sequences all begin with the same blocks (prefix caching): the
split-KV decode kernel (decode_attention.py), launched over the shared prefix with tiles of
BLOCK_M rows drawn from every sequence (each prefix K/V tile is read once per row tile, not
once per sequence), then `_own_keys_kernel` over each sequence's own keys, several KV heads
per program (own contexts are short); that launch merges its result with the prefix's
partial results (or, when it splits the own keys too, decode_attention.py's reduce merges
both launches' partial results).

Capturable in CUDA graphs: the shared prefix's length is read on the device, the split
counts follow host integers only (shared_prefix_num_splits, decode_num_splits).
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels.attention_tiles import dim_order, launch_options, load_e4m3_value_tile, value_column_order
from minivllm.kernels.common import next_power_of_2, split_count
from minivllm.kernels.decode_attention import (
    DECODE_MAX_SPLITS,
    DECODE_SHARED_PREFIX,
    DecodeTiles,
    check_decode_inputs,
    decode_workspace,
    launch_decode_reduce,
    launch_decode_split,
    split_launch_args,
)
from minivllm.kernels.mixed_attention import mixed_config
from minivllm.kernels.pdl import wait_for_previous_kernel


@triton.jit
def _merge_parts(out, lse, part_out_ptr, part_lse_ptr, first_part, num_stored, row_valid,
                 HEAD_DIM: tl.constexpr):
    """out [M, D] (normalised) with log2-sum-exp2 lse [M], merged with each row's stored
    parts first_part .. first_part + num_stored - 1: the softmax over all their keys,
    normalised. An online merge: the running maximum m stays finite (-1e30 at worst), so a
    part with lse = -inf (no keys) gets weight exp2(-inf) = 0, never NaN."""
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.maximum(lse, -1.0e30)
    den = tl.exp2(lse - m)
    acc = out * den[:, None]
    for p in range(num_stored):
        part_lse = tl.load(part_lse_ptr + first_part + p, mask=row_valid, other=float("-inf"))
        part_out = tl.load(part_out_ptr + (first_part + p)[:, None] * HEAD_DIM + offs_d[None, :],
                           mask=row_valid[:, None], other=0.0)
        m_new = tl.maximum(m, part_lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(part_lse - m_new)
        acc = acc * alpha[:, None] + part_out * weight[:, None]
        den = den * alpha + weight
        m = m_new
    return acc / tl.where(den == 0.0, 1.0, den)[:, None]


@triton.jit(do_not_specialize=["num_splits", "part_offset", "num_parts"])
def _own_keys_kernel(
    # The arguments up to num_parts are _decode_split_kernel's (decode_attention.split_launch_args).
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    seq_lens_ptr, block_tables_ptr,
    prefix_blocks_ptr,  # [1] int32: the shared prefix's blocks, which this launch skips
    scale_log2,
    num_q_heads,
    stride_qn, stride_qh,
    stride_on, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    num_splits,  # programs along each sequence's own keys
    part_offset,  # this launch's splits are parts part_offset..; the prefix launch's come first
    num_parts,
    GQA: tl.constexpr,
    HEADS: tl.constexpr,  # KV heads per program
    BLOCK_M: tl.constexpr,  # HEADS * GQA query rows, padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per key tile (the tile has HEADS * BLOCK_N rows)
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # The cascade's second launch: each sequence's own keys, P * BLOCK_SIZE .. seq_len, past the
    # P = prefix_blocks_ptr[0] shared blocks. Own contexts are short (W3: 64-192 tokens), so
    # one KV head per program would leave each program a few tiles, and its fixed costs (the
    # query, the merge, filling the pipeline) would weigh. Here a program takes HEADS KV heads
    # of one sequence: its query rows are their HEADS * GQA query heads, and each key tile
    # stacks the same BLOCK_N tokens of every one of those KV heads (row j: head j // BLOCK_N,
    # token j % BLOCK_N; one token's heads are neighbours in a page). A row's scores are kept
    # only for its own head's keys; the dots do the masked entries' work too (up to GQA 4, as
    # many multiply-adds as one program per head, whose GQA rows are padded to 16).
    head_group = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < HEADS * GQA
    head = head_group * HEADS * GQA + rows
    cols = tl.arange(0, HEADS * BLOCK_N)
    col_token = cols % BLOCK_N
    col_head_off = (head_group * HEADS + cols // BLOCK_N) * stride_ch
    own_head = (rows // GQA)[:, None] == (cols // BLOCK_N)[None, :]
    num_prefix_blocks = tl.load(prefix_blocks_ptr)
    # Own key t is token P * BLOCK_SIZE + t, at block-table entry P + t // BLOCK_SIZE.
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt + num_prefix_blocks
    kv_len = tl.maximum(tl.load(seq_lens_ptr + seq) - num_prefix_blocks * BLOCK_SIZE, 0)
    tiles_per_split = ((kv_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, (kv_len + BLOCK_N - 1) // BLOCK_N)

    # The query and the keys were written before the prefix launch started (kernels/pdl.py):
    # this launch reads them while that one runs, and waits for it only to merge its parts.
    offs_d = tl.arange(0, HEAD_DIM)
    q_offs = seq.to(tl.int64) * stride_qn + head * stride_qh
    q = tl.load(q_ptr + q_offs[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:  # value tiles come in value_column_order
        acc = value_column_order(acc, BLOCK_M, HEAD_DIM)
    for t in range(first_tile, last_tile):
        offs_n = t * BLOCK_N + col_token
        valid = offs_n < kv_len
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=valid, other=0)
        kv_offs = block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + col_head_off
        kv_ptrs = kv_offs[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(own_head & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # online softmax, as in attention_tiles.attend_kv_tiles
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
            v = load_e4m3_value_tile(v_cache_ptr, kv_offs, valid, HEADS * BLOCK_N, HEAD_DIM, True).to(DOT_DTYPE)
        else:
            v = tl.load(v_cache_ptr + kv_ptrs, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
        acc = dim_order(acc, BLOCK_M, HEAD_DIM)

    empty = l_i == 0.0  # no own keys in this split (or a padded row): no weight in the merge
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    wait_for_previous_kernel(PDL)
    first_part = (seq * num_q_heads + head) * num_parts
    if num_splits == 1:
        # The prefix launch has written all its parts (part_offset of them) before this one
        # passed its wait: merge them here, which saves the reduce launch.
        out = _merge_parts(out, lse, part_out_ptr, part_lse_ptr, first_part, part_offset, row_valid, HEAD_DIM)
        o_ptrs = out_ptr + (seq.to(tl.int64) * stride_on + head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = first_part + part_offset + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_valid[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_valid)


# The prefix launch is compute-shaped (BLOCK_M x BLOCK_N tiles on tensor cores, K/V mostly
# from L2) and its bf16 tiles take ~160 KB of shared memory, one program per SM: so at most
# one wave of programs. A second, partial wave costs a whole program's time, and more splits
# add workspace traffic (checked on W3's decode step: benchmarks/kernels/cascade_attention.py
# --sweep).
PREFIX_MIN_TOKENS_PER_SPLIT = 256


@dataclass(frozen=True)
class SharedPrefixConfig:
    """The shared-prefix launch's tiles (a _decode_split_kernel launch): BLOCK_M (sequence,
    head) rows per program, and the split kernel's key tiles."""
    block_m: int
    tiles: DecodeTiles


# Cached: the cascade runs it for every launch, and building frozen dataclasses costs several
# times a lookup (num_rows takes at most the engine's batch sizes times the GQA group).
@functools.cache
def shared_prefix_config(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                         num_rows: int) -> SharedPrefixConfig:
    """Tiles for the shared-prefix launch over a cache of `cache_dtype`: the mixed kernel's
    (the same many-rows x keys work), with BLOCK_M cut down to the rows there are (num_rows =
    B * GQA per KV head), except that a 16-bit cache at D <= 128 takes 64-key tiles in three
    stages: the launch is one wave whose programs see only a few key tiles each. Tuned on
    W3's decode step on an H200 (benchmarks/kernels/cascade_attention.py --sweep), where the
    shorter tiles won over 16-bit caches and lost over FP8 ones."""
    mixed = mixed_config(head_dim, dtype, 1)  # GQA 1: BLOCK_Q is then the whole row tile
    block_m = min(mixed.block_q, max(16, next_power_of_2(num_rows)))
    short_tiles = cache_dtype.itemsize == 2 and head_dim <= 128
    block_n, stages = (64, 3) if short_tiles else (mixed.block_n, mixed.num_stages)
    return SharedPrefixConfig(block_m=block_m,
                              tiles=DecodeTiles(block_n=block_n, num_warps=mixed.num_warps, num_stages=stages))


# The own-keys launch's KV heads per program (at most; the largest power of two that divides
# the model's KV heads).
OWN_KEYS_MAX_HEADS = 4


@dataclass(frozen=True)
class OwnKeysConfig:
    """The own-keys launch's tiles (_own_keys_kernel): HEADS KV heads per program, key tiles
    of BLOCK_N tokens of each of them."""
    heads: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.cache  # as shared_prefix_config: one per model shape
def own_keys_config(head_dim: int, dtype: torch.dtype, num_kv_heads: int) -> OwnKeysConfig:
    """Tiles for the cascade's own-keys launch (_own_keys_kernel): HEADS KV heads per program,
    key tiles of 64 rows at D=128 (HEADS * the tile's tokens; 16 KB of 16-bit keys), three stages.
    Tuned on W3's decode step (256 sequences of 64-192 own tokens, bf16, D=128, 8 KV heads,
    H200): 4 heads x 16 tokens beat 8 x 8, 8 x 16, 2 x 32 and the one-head programs of
    _decode_split_kernel (benchmarks/kernels/cascade_attention.py --sweep)."""
    heads = OWN_KEYS_MAX_HEADS
    while num_kv_heads % heads:
        heads //= 2
    key_rows = max(16, min(64, 16384 // (head_dim * dtype.itemsize)))
    return OwnKeysConfig(heads=heads, block_n=max(1, key_rows // heads), num_warps=4, num_stages=3)


def shared_prefix_num_splits(
    num_row_tiles: int,
    num_kv_heads: int,
    prefix_len: int,
    num_sms: int,
    max_splits: int = DECODE_MAX_SPLITS,
) -> int:
    """Programs along the shared prefix per (row tile, KV head): as many as one wave of
    num_sms programs holds (at least 1), at most one per PREFIX_MIN_TOKENS_PER_SPLIT tokens
    (rounded up) and at most max_splits."""
    one_wave = max(1, num_sms // (num_row_tiles * num_kv_heads))
    return split_count(one_wave, 1, prefix_len, PREFIX_MIN_TOKENS_PER_SPLIT, max_splits)


def launch_own_keys(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    part_out: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    prefix_blocks: torch.Tensor,  # [1] int32 on the device: the shared prefix's blocks
    scale: float,
    num_splits: int,
    part_offset: int,  # the prefix launch's parts per row
    num_parts: int,
    cfg: OwnKeysConfig,
) -> None:
    """The cascade's own-keys launch (_own_keys_kernel)."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    gqa = num_q_heads // num_kv_heads
    heads = cfg.heads
    assert num_kv_heads % heads == 0, f"HEADS={heads} must divide the {num_kv_heads} KV heads"
    _own_keys_kernel[(num_kv_heads // heads, num_splits, num_seqs)](
        *split_launch_args(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                           prefix_blocks, scale, num_splits, part_offset, num_parts),
        GQA=gqa,
        HEADS=heads,
        BLOCK_M=max(16, next_power_of_2(heads * gqa)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n,
        **launch_options(q, k_cache, cfg.num_warps, cfg.num_stages),
    )


def paged_attention_decode_shared_prefix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_prefix_blocks: torch.Tensor,
    scale: float,
    prefix_splits: int = 1,
    suffix_splits: int = 1,
    out: torch.Tensor | None = None,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    prefix_config: SharedPrefixConfig | None = None,
    suffix_config: OwnKeysConfig | None = None,
) -> torch.Tensor:
    """Decode attention (as decode_attention.paged_attention_decode) for a batch whose
    sequences all start with the same P blocks, P = num_prefix_blocks[0] (a 1-element int32
    tensor on the device): block_tables[b, :P] == block_tables[0, :P] for every b, and
    seq_lens[b] >= P * block_size + 1 (at least one own token: the new one) for every b with
    seq_lens[b] > 0.

    Cascade: (1) the shared prefix, for all B * GQA query rows of a KV head at once in
    tiles of BLOCK_M rows, so each prefix K/V tile is read once per row tile instead of
    once per sequence; prefix_splits programs along the prefix; (2) each sequence's own
    keys [P * block_size, seq_len) through _own_keys_kernel, suffix_splits programs per
    group of KV heads; (3) all prefix_splits + suffix_splits partial results of a (sequence, head) are
    merged by their log-sum-exps into out (q's dtype): by the suffix launch itself when
    suffix_splits is 1 (the common case: short own keys, many sequences), else by the
    reduce kernel.

    part_out / part_lse: fp32 workspace of at least B * Hq * (prefix_splits + suffix_splits)
    * D and B * Hq * (prefix_splits + suffix_splits) elements (allocated if None).
    prefix_config overrides shared_prefix_config(), suffix_config own_keys_config().
    No host synchronisation: P and the lengths are read on the device, so a CUDA graph of
    this call serves any P (choose the split counts for the longest P it may see).
    """
    num_seqs, num_q_heads, head_dim = check_decode_inputs(q, k_cache, v_cache, seq_lens, block_tables)
    assert num_prefix_blocks.shape == (1,) and num_prefix_blocks.dtype == torch.int32, (
        "num_prefix_blocks must be a 1-element int32 tensor")
    assert prefix_splits >= 1 and suffix_splits >= 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    gqa = num_q_heads // k_cache.shape[2]
    if prefix_config is None:
        prefix_config = shared_prefix_config(head_dim, q.dtype, k_cache.dtype, num_seqs * gqa)
    if suffix_config is None:
        suffix_config = own_keys_config(head_dim, q.dtype, k_cache.shape[2])
    # Workspace parts per (sequence, head): the prefix splits first, then the suffix's.
    num_parts = prefix_splits + suffix_splits
    part_out, part_lse = decode_workspace(part_out, part_lse, num_seqs * num_q_heads * num_parts, q)
    launch_decode_split(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                        DECODE_SHARED_PREFIX, num_prefix_blocks, scale, prefix_splits, 0, num_parts,
                        prefix_config.block_m, prefix_config.tiles)
    launch_own_keys(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables, num_prefix_blocks,
                    scale, suffix_splits, prefix_splits, num_parts, suffix_config)
    if suffix_splits > 1:  # with one split, the suffix launch has merged (see the kernel)
        launch_decode_reduce(part_out, part_lse, out, num_parts)
    return out
