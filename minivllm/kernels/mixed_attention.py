"""Attention for mixed batches over the paged KV cache, in Triton: `paged_attention_mixed`.

Any batch: prompt chunks attend causally to their cached prefix (read through the block
table) and to themselves; decode rows (query length 1) ride in the same launch. One program
= one tile of BLOCK_Q query tokens x the GQA group of query heads that share one KV head, so
each K/V tile loaded feeds every head of the group. The key loop is attention_tiles.py's
(the cache layout and its FP8 variant are described there).

Capturable in CUDA graphs: the launch grid depends only on tensor shapes; the lengths are
read from query_start_loc and seq_lens on the device.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels.attention_tiles import LOG2E, attend_kv_tiles, check_attention_inputs, launch_options
from minivllm.kernels.common import next_power_of_2
from minivllm.kernels.pdl import wait_for_previous_kernel


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence that owns query tile `tile` (binary search, log2(B) scalar loads).

    Sequence b's tiles are numbered from query_start_loc[b] // BLOCK_Q + b on: the "+ b"
    leaves room for the partial tile a sequence may end with, so no host-side prefix sum
    of tile counts is needed and the grid (N // BLOCK_Q + B tiles) depends on shapes only.
    Returns the last b whose first tile is <= tile.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit(do_not_specialize=["first_seq", "num_seqs", "tile_offset"])
def _mixed_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    first_seq,  # sequences before this one are not this launch's
    num_seqs,
    tile_offset,  # number of the first tile (query_start_loc[0] // BLOCK_Q)
    scale_log2,
    stride_qn, stride_qh,
    stride_on, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    GQA: tl.constexpr,  # query heads per KV head
    GQA_PAD: tl.constexpr,  # GQA rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    DOT_DTYPE: tl.constexpr,  # see attention_tiles.dot_dtype()
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    # Tile rows are (query token, head of the GQA group) pairs: row r is token r // GQA_PAD,
    # head kv_head * GQA + r % GQA_PAD, so one K/V tile serves the whole group.
    BLOCK_M: tl.constexpr = BLOCK_Q * GQA_PAD
    # Offsets applied here, not by slicing on the host: a sliced pointer's alignment would
    # be specialised on, a fresh compilation for each.
    query_start_loc_ptr += first_seq
    seq_lens_ptr += first_seq
    block_tables_ptr += first_seq.to(tl.int64) * stride_bt
    # Launch the last tiles first: late tiles of long prompts see the most keys, and
    # starting the longest work first evens out the tail of the launch.
    tile = tile_offset + tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    wait_for_previous_kernel(PDL)

    seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_tile_start = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_tile_start >= q_len:  # spare tile (the grid is an upper bound)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # tokens already cached before this chunk

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + rows // GQA_PAD  # token index within the chunk
    head = kv_head * GQA + rows % GQA_PAD
    row_valid = (q_idx < q_len) & (rows % GQA_PAD < GQA)
    q_pos = prefix_len + q_idx  # absolute position of each row's token
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_begin + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None], other=0.0).to(DOT_DTYPE)

    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head * stride_ch
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Keys 0 .. prefix_len + q_tile_start are visible to every row of the tile: whole
    # BLOCK_N tiles of them need no mask at all (the bulk of the work for long contexts).
    num_unmasked = (prefix_len + q_tile_start + 1) // BLOCK_N
    acc, l_i, m_i = attend_kv_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_off,
        0, num_unmasked, seq_len, q_pos, scale_log2, stride_cb, stride_cs,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, DOT_PRECISION)
    # The rest, up to the tile's last token, crosses the causal diagonal.
    kv_end = prefix_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    acc, l_i, m_i = attend_kv_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_off,
        num_unmasked, (kv_end + BLOCK_N - 1) // BLOCK_N, kv_end, q_pos, scale_log2, stride_cb, stride_cs,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, True, DOT_PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only; keeps them finite
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


# Query chunks up to this long take the mixed kernel's short-prompt tiles (mixed_config).
SHORT_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class MixedConfig:
    """The mixed kernel's tiles: BLOCK_Q query tokens x the padded GQA group per program,
    BLOCK_N keys per inner step."""
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int


def mixed_config(head_dim: int, dtype: torch.dtype, gqa: int, max_query_len: int | None = None) -> MixedConfig:
    """Tile sizes for the mixed kernel: BLOCK_M = BLOCK_Q * GQA_PAD query rows per program.

    Shared memory per program is ~ (BLOCK_M + 2 * stages * BLOCK_N) * D * bytes and must
    stay under the H100/H200's 227 KB. The bf16/fp16 D <= 128 tiles were tuned on an H200
    (bf16, D=128): on an 8192-token causal prompt, and, for steps whose query chunks are at
    most SHORT_PROMPT_TOKENS long (max_query_len), on a 1,024-token prompt and on a step of
    W1's prompts. Short chunks leave each program only a few key tiles: smaller tiles give
    more programs and less masked work in the causal triangle.
    """
    short = max_query_len is not None and max_query_len <= SHORT_PROMPT_TOKENS
    return _mixed_config(head_dim, dtype, gqa, short)


# Cached: a step's attention asks for the same few configs in every layer, and building a
# frozen dataclass costs several times a lookup.
@functools.cache
def _mixed_config(head_dim: int, dtype: torch.dtype, gqa: int, short: bool) -> MixedConfig:
    elt = dtype.itemsize
    row_bytes = head_dim * elt
    if elt == 2 and head_dim <= 128:  # bf16/fp16, D <= 128: 164 KB at D=128 (80 KB short)
        block_m, block_n, warps, stages = (64, 64, 4, 2) if short else (128, 128, 8, 2)
    elif row_bytes <= 512:  # bf16 D=256, fp32 D<=128
        block_m, block_n, warps, stages = 64, 32, 4, 2
    else:  # fp32 D=256
        block_m, block_n, warps, stages = 32, 16, 4, 2
    gqa_pad = next_power_of_2(gqa)
    block_q = max(1, block_m // gqa_pad)
    return MixedConfig(block_q=block_q, block_n=block_n, num_warps=warps, num_stages=stages)


def paged_attention_mixed(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: MixedConfig | None = None,
    first_seq: int = 0,
    first_token: int = 0,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [N, Hq, D] over the paged cache, for any mix of prompt chunks
    (with or without a cached prefix) and decode rows. The new tokens' K/V must already be
    in the cache (fused_ops.qk_norm_rope_store first). Returns out [N, Hq, D] (q's dtype).

    query_start_loc [B+1] int32, seq_lens [B] int32, block_tables [B, max_blocks] int32.
    first_seq > 0: compute only sequences first_seq..B-1 (rows first_token.. of out; other
    rows are left as they are); first_token must equal query_start_loc[first_seq], given
    as a host int so that nothing synchronises.
    max_query_len: the longest sequence's new tokens, if known on the host (it picks the
    tiles, see mixed_config). `config` overrides mixed_config().
    """
    num_q_heads, num_kv_heads, head_dim, block_size = check_attention_inputs(q, k_cache, v_cache, block_tables)
    num_tokens = q.shape[0]
    assert query_start_loc.shape == (seq_lens.shape[0] + 1,), "query_start_loc must be [B + 1]"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0] - first_seq
    if num_tokens == 0 or num_seqs <= 0:
        return out
    gqa = num_q_heads // num_kv_heads
    cfg = mixed_config(head_dim, q.dtype, gqa, max_query_len) if config is None else config
    block_q = cfg.block_q
    # Tiles are numbered query_start_loc[b] // BLOCK_Q + b (see _find_seq): the last one is
    # below num_tokens // BLOCK_Q + B, the first is first_token // BLOCK_Q.
    tile_offset = first_token // block_q
    grid = (num_tokens // block_q + num_seqs - tile_offset, num_kv_heads)
    _mixed_attention_kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_tables,
        first_seq,
        num_seqs,
        tile_offset,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GQA=gqa,
        GQA_PAD=next_power_of_2(gqa),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        **launch_options(q, k_cache, cfg.num_warps, cfg.num_stages),
    )
    return out
