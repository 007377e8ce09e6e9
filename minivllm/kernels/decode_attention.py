"""Split-KV decode attention over the paged KV cache, in Triton: `paged_attention_decode`.

One query token per sequence: decode-only batches (the hot path that runs inside CUDA graphs)
and the leading decodes of a mixed step. Flash-decoding: each (sequence, KV head) context is
split into num_splits contiguous ranges handled by separate programs, so that small batches
still fill the GPU; a second kernel merges the partial results through their log-sum-exps.
The query heads of a GQA group form the rows of one tile (padded to a power of two of at
least 16, the smallest tl.dot M) so the scores and the value sum run on tensor cores and K/V
are read once. The key loop is attention_tiles.py's (the cache layout and its FP8 variant are
described there). Over an FP8 cache on a GPU the split kernel is kernels/fp8_decode.py's
(decode_config chooses); its parts merge here the same way.

cascade_attention.py launches the same split kernel over a prefix that the whole batch
shares (its DECODE_SHARED_PREFIX mode) and merges its parts with the same reduce.

Capturable in CUDA graphs: the split count, and so the launch grid, depends only on host
integers (decode_num_splits: the batch shape and max_seq_len); the lengths are read from
seq_lens on the device.
"""

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from minivllm.kernels import fp8_decode
from minivllm.kernels.attention_tiles import LOG2E, attend_kv_tiles, check_attention_inputs, launch_options
from minivllm.kernels.common import INTERPRET, cdiv, next_power_of_2, split_count
from minivllm.kernels.pdl import pdl_options, wait_for_previous_kernel

# _decode_split_kernel's MODE.
DECODE_PLAIN, DECODE_SHARED_PREFIX = 0, 1


# Split counts are runtime arguments (not specialised): the engine's counts follow the batch
# and its lengths, and every distinct compile-time value would be a fresh compilation.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "part_offset", "num_parts"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,
    out_ptr,  # [B, Hq, D], written directly when num_parts == 1
    part_out_ptr,  # [B, Hq, num_parts, D] fp32: each part's normalised output
    part_lse_ptr,  # [B, Hq, num_parts] fp32: each part's log2-sum-exp2 of scores
    seq_lens_ptr, block_tables_ptr,
    prefix_blocks_ptr,  # [1] int32 (cascade launches): blocks every block table starts with
    scale_log2,
    num_q_heads,
    stride_qn, stride_qh,
    stride_on, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    num_splits,  # programs along the keys of one context
    part_offset,  # this launch's splits are workspace parts part_offset..
    num_parts,  # parts per (sequence, head) row that the reduce merges
    num_seqs,
    GQA: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program (a power of two >= 16, the tl.dot M)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,  # DECODE_PLAIN or DECODE_SHARED_PREFIX
    DOT_DTYPE: tl.constexpr,  # see attention_tiles.dot_dtype()
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    # Two uses of one kernel (they differ only in which query rows and keys a program has):
    # * DECODE_PLAIN: rows = the GQA group of sequence program_id(2) (padded to BLOCK_M),
    #   keys = its whole context;
    # * DECODE_SHARED_PREFIX (cascade): rows = tile program_id(2) of all B * GQA (sequence,
    #   head) pairs of this KV head, keys = the shared prefix (the first P = prefix_blocks_ptr[0]
    #   blocks of block table row 0, which every row shares), read once for the whole tile
    #   instead of once per sequence; a full tile of rows keeps the tensor cores busy.
    #   P is read on the device so that a CUDA graph serves any shared prefix.
    # Programs start in launch order, program_id(0) fastest: a row tile's heads and splits
    # are neighbours, and row tiles start in batch order (the runner puts the longest
    # contexts first, so that no long one starts last and sets the launch's tail).
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    if MODE == 1:  # DECODE_SHARED_PREFIX
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < num_seqs * GQA
        seq = rows // GQA  # [BLOCK_M]: a sequence per row
        head = kv_head * GQA + rows % GQA
        block_table_ptr = block_tables_ptr
        kv_len = tl.load(prefix_blocks_ptr) * BLOCK_SIZE
    else:
        rows = tl.arange(0, BLOCK_M)
        row_valid = rows < GQA
        seq = tl.program_id(2)  # one sequence for the whole tile
        head = kv_head * GQA + rows
        block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_len = tl.load(seq_lens_ptr + seq)
    # The context is shared evenly across the splits in whole BLOCK_N tiles (so only its
    # very last tile needs masks). Real lengths come from the device, the split count from
    # the launch: short contexts leave their last splits empty.
    # (Ceiling divisions are spelled out: tl.cdiv is a jitted call, slow in the interpreter.)
    tiles_per_split = ((kv_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N
    split_len = tiles_per_split * BLOCK_N
    num_keys = tl.maximum(tl.minimum(kv_len - split * split_len, split_len), 0)

    offs_d = tl.arange(0, HEAD_DIM)
    wait_for_previous_kernel(PDL)
    q_offs = seq.to(tl.int64) * stride_qn + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_offs[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    q = q.to(DOT_DTYPE)

    kv_head_off = kv_head * stride_ch
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first_tile = split * tiles_per_split
    num_full = num_keys // BLOCK_N
    # q_pos is unused without CAUSAL (m_i stands in for it).
    acc, l_i, m_i = attend_kv_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_off,
        first_tile, first_tile + num_full, kv_len, m_i, scale_log2, stride_cb, stride_cs,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, DOT_PRECISION)
    acc, l_i, m_i = attend_kv_tiles(  # at most one ragged tile, at the end of the context
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_off,
        first_tile + num_full, first_tile + (num_keys + BLOCK_N - 1) // BLOCK_N, kv_len, m_i,
        scale_log2, stride_cb, stride_cs,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, False, DOT_PRECISION)

    # l_i == 0 only for an empty split (or seq_len 0, i.e. a padded row): write zeros
    # and lse = -inf so the merge gives it no weight.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + (seq.to(tl.int64) * stride_on + head * stride_oh)[:, None] + offs_d[None, :]
    if num_parts == 1:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = (seq * num_q_heads + head) * num_parts + part_offset + split
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_valid[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_parts"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_q_heads,
    stride_on, stride_oh,
    num_parts,  # parts per (sequence, head): splits, or prefix + suffix splits
    HEAD_DIM: tl.constexpr,
    PARTS_PER_STEP: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    # One program per (sequence, query head): out = sum_s w_s * o_s / sum_s w_s with
    # w_s = 2 ** (lse_s - max lse): the parts' softmaxes rescaled to a common maximum.
    # One pass, PARTS_PER_STEP parts at a time (their lse and outputs loaded together: the
    # kernel is a few dependent loads long), the running maximum rescaling what came before.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first_part = (seq * num_q_heads + head) * num_parts
    steps = tl.arange(0, PARTS_PER_STEP)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    wait_for_previous_kernel(PDL)
    for start in range(0, num_parts, PARTS_PER_STEP):
        valid = start + steps < num_parts
        part = first_part + start + steps
        lse = tl.load(part_lse_ptr + part, mask=valid, other=float("-inf"))
        o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys so far (seq_len 0): weights 0
        alpha = tl.exp2(m - base)
        w = tl.exp2(lse - base)
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        m = m_new
    out = acc / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + seq.to(tl.int64) * stride_on + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


# Split-KV heuristic, tuned on an H200 (benchmarks/kernels/attention_kernels.py --sweep, and
# W1's decode batches in benchmarks/kernels/decode_w1.py and in the engine's graphs): a wave
# is as many (seq, kv head, split) programs per SM as decode_config's tiles say, and a launch
# aims for its `waves` of them. For multi-warp tiles 3 an SM beats 6 on W1 (an extra split
# costs more than the short launch tail it removes); the FP8 one-warp tiles aim for as many
# as fit on an SM (by shared memory), as each is one warp.
DECODE_PROGRAMS_PER_SM = 3
FP8_DECODE_ONE_WARP_PROGRAMS_PER_SM = 7
MOST_DECODE_PROGRAMS_PER_SM = max(DECODE_PROGRAMS_PER_SM, FP8_DECODE_ONE_WARP_PROGRAMS_PER_SM,
                                  fp8_decode.PROGRAMS_PER_SM)
MOST_DECODE_WAVES = max(1.0, fp8_decode.SPLIT_WAVES, fp8_decode.FEW_CONTEXTS_SPLIT_WAVES)
# From this many waves of contexts a launch splits none of them (the waves after the first
# fill in as the first wave's programs end).
DECODE_ONE_SPLIT_MIN_WAVES = 1.2
DECODE_MIN_TOKENS_PER_SPLIT = 128  # a split shorter than this costs more than it saves
DECODE_MAX_SPLITS = 32


# The batch size from which decode_config's 16-bit tiles change.
DECODE_SHORT_TILE_MIN_SEQS = 160


@dataclass(frozen=True)
class DecodeTiles:
    """_decode_split_kernel's tiles: BLOCK_N keys per tile, and the program's warps and
    pipeline stages."""
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeConfig:
    """A decode launch's kernel and tiles, and the split target decode_num_splits aims at
    (decode_num_splits_for): programs_per_sm programs on every SM make a wave, and a launch
    aims for `waves` of them (few_contexts_waves where its contexts fill a fraction of a wave
    within the few_contexts range)."""
    tiles: DecodeTiles | None  # None: kernels/fp8_decode.py's Gluon kernel, whose tiles are fixed
    programs_per_sm: int
    waves: float = 1.0
    few_contexts: tuple[float, float] = (0.0, 0.0)
    few_contexts_waves: float = 1.0


# Cached: it runs for every decode launch, and building a frozen dataclass costs several
# times a lookup (num_seqs takes at most the engine's batch sizes).
@functools.cache
def decode_config(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype, num_seqs: int) -> DecodeConfig:
    """Tile sizes for the split-KV decode kernel (memory-bound: K/V tiles in flight matter),
    for a batch of num_seqs queries of `dtype` over a cache of `cache_dtype`, and the split
    target for decode_num_splits: programs_per_sm (a wave of programs), waves, and the waves
    (few_contexts_waves) for contexts filling a fraction of a wave within few_contexts.

    Tuned for D=128 on an H200 over W1's decode batches (benchmarks/kernels/decode_w1.py).
    A 16-bit cache, per batch size: with few sequences (several splits per context, or few
    programs per SM) bigger tiles keep more bytes in flight per program; with many (every
    context in one split, several programs per SM) smaller programs do. So 128-key tiles,
    two stages, 4 warps; from DECODE_SHORT_TILE_MIN_SEQS sequences 64-key tiles with 2 warps.
    An FP8 cache at D=128 under 16-bit queries on a GPU takes kernels/fp8_decode.py, faster
    on every W1 batch size (one-warp programs, keys-major, no shared-memory round trip between
    the loads and the tensor cores): tiles None, aiming for fp8_decode.SPLIT_WAVES
    waves where a launch's contexts fill less than about one (and fewer waves for far fewer
    contexts, fp8_decode.FEW_CONTEXTS_SPLIT_WAVES). Elsewhere (other head sizes,
    Triton's interpreter) an FP8 tile costs more instructions per byte (the widening), so one
    warp, free of cross-warp reductions, with 32-key tiles and five stages is fastest at every W1
    batch size, its splits chosen to fill an SM with them. (Triton shares a loop's stages
    between the block-table load and the K/V loads whose addresses it gives: up to four
    stages leave K and V one buffer, so a tile's loads start only after the previous tile's
    math; five give them two, and the next tile's loads fly during this one's math, which
    the one-warp FP8 program needs.) One sequence over a 16-bit cache (W2's step, timed in
    benchmarks/latency.py rather than alone: its layer is a chain of small dependent
    kernels) takes 64-key tiles with 2 warps, so its splits are one short tile each. Query
    rows over 256 bytes (D=256, or fp32 at D=128) keep tiles of 16 KB of keys in q's dtype
    (not re-tuned; 8 KB read from an FP8 cache)."""
    if fp8_decode.supports(head_dim, dtype, cache_dtype) and not INTERPRET:
        return DecodeConfig(tiles=None, programs_per_sm=fp8_decode.PROGRAMS_PER_SM, waves=fp8_decode.SPLIT_WAVES,
                            few_contexts=fp8_decode.FEW_CONTEXTS_WAVES,
                            few_contexts_waves=fp8_decode.FEW_CONTEXTS_SPLIT_WAVES)
    if cache_dtype == torch.float8_e4m3fn and head_dim <= 128:
        return DecodeConfig(tiles=DecodeTiles(block_n=32, num_warps=1, num_stages=5),
                            programs_per_sm=FP8_DECODE_ONE_WARP_PROGRAMS_PER_SM)
    row_bytes = head_dim * dtype.itemsize
    if row_bytes > 512:
        tiles = DecodeTiles(block_n=16, num_warps=4, num_stages=2)
    elif row_bytes > 256:
        tiles = DecodeTiles(block_n=32, num_warps=4, num_stages=3)
    elif num_seqs >= DECODE_SHORT_TILE_MIN_SEQS or num_seqs == 1:
        tiles = DecodeTiles(block_n=64, num_warps=2, num_stages=2)
    else:
        tiles = DecodeTiles(block_n=128, num_warps=4, num_stages=2)
    return DecodeConfig(tiles=tiles, programs_per_sm=DECODE_PROGRAMS_PER_SM)


def decode_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    programs_per_sm: int,
    max_splits: int = DECODE_MAX_SPLITS,
    waves: float = 1.0,
    few_contexts: tuple[float, float] = (0.0, 0.0),
    few_contexts_waves: float = 1.0,
) -> int:
    """How many programs share one (sequence, KV head) context. Depends only on host
    integers (the batch shape, max_seq_len, the GPU), never on device data, so a captured
    graph keeps a valid launch. A wave is programs_per_sm programs on every SM (the launch's
    decode_config() says how many, and how many waves it aims for). Contexts that fill
    DECODE_ONE_SPLIT_MIN_WAVES waves are not split; fewer are split into enough programs for
    `waves` waves (few_contexts_waves where they fill a fraction of a wave within the
    few_contexts range [low, high)), but no split shorter than DECODE_MIN_TOKENS_PER_SPLIT
    tokens of max_seq_len."""
    wave = programs_per_sm * num_sms
    num_contexts = num_seqs * num_kv_heads
    if num_contexts >= DECODE_ONE_SPLIT_MIN_WAVES * wave:
        return 1
    if few_contexts[0] * wave <= num_contexts < few_contexts[1] * wave:
        waves = few_contexts_waves
    return split_count(math.ceil(waves * wave), num_contexts, max_seq_len, DECODE_MIN_TOKENS_PER_SPLIT,
                       max_splits)


def decode_num_splits_for(config: DecodeConfig, num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                          max_splits: int = DECODE_MAX_SPLITS) -> int:
    """decode_num_splits for a launch with decode_config's `config` (its programs an SM and waves)."""
    return decode_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, config.programs_per_sm, max_splits,
                             config.waves, config.few_contexts, config.few_contexts_waves)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, Hq, D] holds one new token per sequence (row b = sequence b),
    at position seq_lens[b] - 1, attending to cached tokens 0 .. seq_lens[b] - 1 (its own
    K/V must already be stored). seq_lens[b] == 0 (a padded row) gives zeros.

    num_splits: programs per (sequence, KV head); pick it with decode_num_splits().
    part_out / part_lse: fp32 workspace with at least B * Hq * num_splits * D and
    B * Hq * num_splits elements (allocated here if None; pass preallocated buffers under
    CUDA graphs). Unused when num_splits == 1. `config` overrides decode_config().
    """
    num_seqs, num_q_heads, head_dim = check_decode_inputs(q, k_cache, v_cache, seq_lens, block_tables)
    assert num_splits >= 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    cfg = decode_config(head_dim, q.dtype, k_cache.dtype, num_seqs) if config is None else config
    if num_splits > 1:
        part_out, part_lse = decode_workspace(part_out, part_lse, num_seqs * num_q_heads * num_splits, q)
    else:
        part_out = part_lse = out  # not touched by the kernel when num_parts == 1
    if cfg.tiles is None:
        fp8_decode.launch_fp8_decode(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                                     scale * LOG2E, num_splits)
    else:
        # One sequence's GQA group per program, padded to a power of two >= 16 (tl.dot's M).
        block_m = max(16, next_power_of_2(num_q_heads // k_cache.shape[2]))
        launch_decode_split(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                            DECODE_PLAIN, None, scale, num_splits, 0, num_splits, block_m, cfg.tiles)
    if num_splits > 1:
        launch_decode_reduce(part_out, part_lse, out, num_splits)
    return out


def check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor) -> tuple[int, int, int]:
    """check_attention_inputs, plus one query row per sequence. Returns (B, Hq, D)."""
    num_q_heads, _, head_dim, _ = check_attention_inputs(q, k_cache, v_cache, block_tables)
    num_seqs = seq_lens.shape[0]
    assert q.shape[0] == num_seqs, (
        f"decode expects one query row per sequence: q has {q.shape[0]} rows, {num_seqs} sequences")
    return num_seqs, num_q_heads, head_dim


def decode_workspace(part_out: torch.Tensor | None, part_lse: torch.Tensor | None, rows: int,
                     q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV fp32 workspace ([rows, D] outputs, [rows] LSEs), allocated if not given."""
    head_dim = q.shape[-1]
    if part_out is None:
        part_out = torch.empty(rows * head_dim, dtype=torch.float32, device=q.device)
    if part_lse is None:
        part_lse = torch.empty(rows, dtype=torch.float32, device=q.device)
    assert part_out.dtype == part_lse.dtype == torch.float32, "workspace must be fp32"
    assert part_out.numel() >= rows * head_dim and part_lse.numel() >= rows, (
        f"decode workspace too small: {rows} (sequence, head, part) rows x {head_dim} needed")
    return part_out, part_lse


def split_launch_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    part_out: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    prefix_blocks: torch.Tensor | None,  # [1] int32 on the device: the shared prefix's blocks (cascade)
    scale: float,
    num_splits: int,
    part_offset: int,  # this launch's splits are workspace parts part_offset..
    num_parts: int,
) -> tuple[Any, ...]:
    """The leading arguments of _decode_split_kernel and of the cascade's _own_keys_kernel
    (the same in both), in order. (Positional: a launch's Python cost is paid by every eager
    step.)"""
    return (q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
            seq_lens if prefix_blocks is None else prefix_blocks,  # (a placeholder pointer when unused)
            scale * LOG2E,
            q.shape[1],
            q.stride(0), q.stride(1),
            out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0),
            num_splits,
            part_offset,
            num_parts)


def launch_decode_split(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    part_out: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    mode: int,  # DECODE_PLAIN or DECODE_SHARED_PREFIX
    prefix_blocks: torch.Tensor | None,  # [1] int32 on the device: the shared prefix's blocks (cascade)
    scale: float,
    num_splits: int,
    part_offset: int,
    num_parts: int,
    block_m: int,  # query rows per program: a power of two >= 16, and >= the GQA group in DECODE_PLAIN
    tiles: DecodeTiles,
) -> None:
    """One launch of _decode_split_kernel (plain decode or the cascade's prefix)."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    gqa = num_q_heads // num_kv_heads
    if mode == DECODE_SHARED_PREFIX:  # tiles of block_m (sequence, head) rows over all sequences
        num_row_tiles = cdiv(num_seqs * gqa, block_m)
    else:  # one sequence's GQA group per program
        num_row_tiles = num_seqs
    _decode_split_kernel[(num_kv_heads, num_splits, num_row_tiles)](
        *split_launch_args(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                           prefix_blocks, scale, num_splits, part_offset, num_parts),
        num_seqs,
        GQA=gqa,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=tiles.block_n,
        MODE=mode,
        **launch_options(q, k_cache, tiles.num_warps, tiles.num_stages),
    )


def launch_decode_reduce(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_parts: int) -> None:
    """One launch of _decode_reduce_kernel: each (sequence, head) row's num_parts parts merged into out."""
    num_seqs, num_q_heads, head_dim = out.shape
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        part_out, part_lse, out,
        num_q_heads,
        out.stride(0), out.stride(1),
        num_parts,
        HEAD_DIM=head_dim,
        PARTS_PER_STEP=DECODE_MAX_SPLITS,  # a plain decode's parts in one step
        **pdl_options(out.device),
        num_warps=1,  # a few dependent loads long: one warp needs no cross-warp sums
    )
