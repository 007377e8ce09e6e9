"""Attention over the paged KV cache, in Triton.

Two kernels share one inner loop (`_attend_kv_tiles`: for each tile of keys, the scores, an
online softmax update and the weighted sum of values, all accumulated in fp32), a third
(`_own_keys_kernel`) runs the same steps over tiles of several KV heads; three entry points
launch them:

* `paged_attention_mixed` - any batch: prompt chunks attend causally to their cached prefix
  (read through the block table) and to themselves; decode rows (query length 1) ride in
  the same launch. One program = one tile of BLOCK_Q query tokens x the GQA group of query
  heads that share one KV head, so each K/V tile loaded feeds every head of the group.

* `paged_attention_decode` - one query token per sequence: decode-only batches (the hot path
  that runs inside CUDA graphs) and the leading decodes of a mixed step. Flash-decoding: each
  (sequence, KV head) context is split into num_splits contiguous ranges handled by separate
  programs, so that small batches still fill the GPU; a second kernel merges the partial
  results through their log-sum-exps. The query heads of a GQA group form the rows of one
  tile (padded to a power of two of at least 16, the smallest tl.dot M) so the scores and the
  value sum run on tensor cores and K/V are read once. Over an FP8 cache on a GPU the split
  kernel is kernels/fp8_decode.py's (decode_config chooses); its parts merge here the same way.

* `paged_attention_decode_shared_prefix` - cascade decode, for batches whose sequences all
  begin with the same blocks (prefix caching): the split kernel, launched over the shared
  prefix with tiles of BLOCK_M rows drawn from every sequence (each prefix K/V tile is read
  once per row tile, not once per sequence), then `_own_keys_kernel` over each sequence's
  own keys, several KV heads per program (own contexts are short); that launch merges its
  result with the prefix's partial results (or, when it splits the own keys too, the
  reduce merges both launches' partial results).

Layout (see minivllm/attention/metadata.py): k_cache, v_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; token t of sequence b lives in block
block_tables[b, t // block_size] at offset t % block_size. K/V tiles are gathered token by
token (each token looks up its block id), which makes BLOCK_N independent of block_size.
The cache holds q's dtype, or float8 e4m3 (an FP8 KV cache, half the bytes to read): its
tiles are widened in registers right after the load, to the dtype the dots run in
(`dot_dtype`: fp16 under bf16 queries, see there).

Everything is capturable in CUDA graphs: no host synchronisation, and launch grids depend
only on tensor shapes and on the `max_seq_len` argument (for decode); actual lengths are
read from seq_lens on the device.
"""

import math

import torch
import triton
import triton.language as tl

from minivllm.kernels import (E4M3_WORD_TO_FP16_PTX, INTERPRET, INTERPRETED, cdiv, dot_precision, fp8_decode,
                              next_power_of_2, split_count)
from minivllm.kernels.pdl import pdl_options, wait_for_previous_kernel

LOG2E = 1.4426950408889634  # softmax runs in base 2 (exp2 is the native instruction)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tl.dtype:
    """The dtype of the kernels' tl.dot inputs (the query tile, the K/V tiles, the softmax
    weights); accumulation is always fp32. q's own dtype, except that an FP8 cache under
    bf16 queries runs in fp16: Hopper widens e4m3 to fp16 in one instruction per pair but
    to bf16 only through fp16 (three), enough to make the conversion, not memory, the
    decode kernel's limit. fp16 holds every e4m3 value exactly and has the finer mantissa;
    queries must stay below its 65,504 range, which normed attention queries do by far."""
    if cache_dtype == torch.float8_e4m3fn and q_dtype == torch.bfloat16:
        return tl.float16
    return _TL_DTYPES[q_dtype]


@triton.jit
def _e4m3_bits_to_f16(b):
    # An e4m3 byte (in an int32) as fp16: sign, exponent and mantissa moved into fp16's places
    # give the value / 256 (exponent biases 7 and 15; subnormals included), so scale back.
    return (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _load_e4m3_value_tile(ptr, row_offs, row_valid, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr):
    """A [ROWS, HEAD_DIM] tile of an FP8 (e4m3) cache, rows at element offsets row_offs,
    widened to fp16. For the value tile of P @ V: the dot reads V along its rows, and
    Hopper has no transposing shared-memory load for 8-bit data, so a plain fp8 load would
    be read back from shared memory a byte at a time. Loaded as 4-byte words and widened
    in registers, the fp16 tile goes through the transposing 16-bit load instead. Its columns
    come in _value_column_order (the caller's P @ V then has its columns in that order too).
    Rows with row_valid False read zeros (if MASK)."""
    words_ptr = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    offs_w = tl.arange(0, HEAD_DIM // 4)
    ptrs = words_ptr + (row_offs // 4)[:, None] + offs_w[None, :]  # rows start 4-byte aligned (D >= 16)
    if MASK:
        w = tl.load(ptrs, mask=row_valid[:, None], other=0)
    else:
        w = tl.load(ptrs)
    if INTERPRETED:  # inline PTX does not run in Triton's interpreter
        b0 = _e4m3_bits_to_f16(w & 0xFF)
        b1 = _e4m3_bits_to_f16((w >> 8) & 0xFF)
        b2 = _e4m3_bits_to_f16((w >> 16) & 0xFF)
        b3 = _e4m3_bits_to_f16((w >> 24) & 0xFF)
    else:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            asm=E4M3_WORD_TO_FP16_PTX,
            constraints="=h,=h,=h,=h,r", args=[w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    # join adds a last axis: [.., 2] of (b0, b2) then of that and (b1, b3) gives b0 b1 b2 b3.
    v = _value_column_order(tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (ROWS, HEAD_DIM)), ROWS, HEAD_DIM)
    if INTERPRETED:
        return v
    # Triton picks a mma.sync dot's operand layout (the decode kernels') from what its inputs
    # were loaded as, and takes the joins above for a sub-16-bit load: the P @ V dot's kWidth
    # would be 4, whose transposing loads of this tile conflict in shared memory (two
    # wavefronts each instead of one). An impure identity hides the chain, and the
    # dot takes the plain fp16 layout (kWidth 2); ptxas drops the mov.
    return tl.inline_asm_elementwise(asm="mov.b32 $0, $1;", constraints="=r,r", args=[v], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit
def _value_column_order(x, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """x's columns reordered: d = 16 j + 8 h + e goes to (HEAD_DIM / 2) h + 8 j + e (HEAD_DIM // 16
    groups j of two halves h). A thread holds 16 consecutive columns of a widened FP8 tile;
    stored as they are, the first 16-byte stores of 8 neighbouring threads would meet only
    every other 16-byte bank group, each twice (2-way bank conflicts); reordered, they meet
    each once. _dim_order undoes it."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, HEAD_DIM // 16, 2, 8)), (0, 2, 1, 3)), (ROWS, HEAD_DIM))


@triton.jit
def _dim_order(x, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The inverse of _value_column_order."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, 2, HEAD_DIM // 16, 8)), (0, 2, 1, 3)), (ROWS, HEAD_DIM))


# ----------------------------------------------------------------------------------------
# Shared inner loop
# ----------------------------------------------------------------------------------------
@triton.jit
def _attend_kv_tiles(
    acc, l_i, m_i,  # running output [M, D] (unnormalised), softmax denominator [M], row max [M]
    q,  # [M, D] query tile
    k_cache_ptr, v_cache_ptr,
    block_table_ptr,  # this sequence's row of block_tables
    kv_head_off,  # kv_head * stride of the head axis
    tile_begin, tile_end,  # key tiles [tile_begin, tile_end), BLOCK_N keys each
    kv_len,  # keys at positions >= kv_len are not attended (and not read)
    q_pos,  # [M] position of each query row (used when CAUSAL)
    scale_log2,  # softmax scale * log2(e)
    stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK_KV: tl.constexpr,  # tiles may reach past kv_len: mask loads and scores
    CAUSAL: tl.constexpr,  # tiles may hold keys after some query row: causal mask
    DOT_PRECISION: tl.constexpr,
):
    # The whole loop is one helper (not one call per tile) because Triton's interpreter
    # pays a large fixed cost for every call of a jitted function; compiled, it is inlined.
    offs_d = tl.arange(0, HEAD_DIM)
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:  # value tiles come in _value_column_order
        acc = _value_column_order(acc, acc.shape[0], HEAD_DIM)
    for t in range(tile_begin, tile_end):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_valid = offs_n < kv_len
        # Each token looks up its page; tokens of one page repeat the same id (an L1 hit).
        if MASK_KV:
            block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=kv_valid, other=0)
        else:
            block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
        # int64: block_id * stride_cb can pass 2**31 elements in a large cache.
        kv_offs = block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head_off
        kv_ptrs = kv_offs[:, None] + offs_d[None, :]
        if MASK_KV:
            k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_valid[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_ptrs)
        k = k.to(q.dtype)  # an FP8 cache's tile (q is in the dots' dtype); a no-op otherwise

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N], base 2
        if CAUSAL:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & kv_valid[None, :], s, float("-inf"))
        elif MASK_KV:
            s = tl.where(kv_valid[None, :], s, float("-inf"))

        # Online softmax. m_i starts at a finite -1e30 rather than -inf, so a row whose keys
        # are all masked so far keeps alpha = exp2(0) = 1 and p = 0 instead of NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

        if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
            v = _load_e4m3_value_tile(v_cache_ptr, kv_offs, kv_valid, BLOCK_N, HEAD_DIM, MASK_KV).to(q.dtype)
        else:
            if MASK_KV:
                v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_valid[:, None], other=0.0)
            else:
                v = tl.load(v_cache_ptr + kv_ptrs)
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
        acc = _dim_order(acc, acc.shape[0], HEAD_DIM)
    return acc, l_i, m_i


# ----------------------------------------------------------------------------------------
# Mixed batches: prompt chunks over a cached prefix, plus decode rows
# ----------------------------------------------------------------------------------------
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
    DOT_DTYPE: tl.constexpr,  # see dot_dtype()
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
    acc, l_i, m_i = _attend_kv_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_off,
        0, num_unmasked, seq_len, q_pos, scale_log2, stride_cb, stride_cs,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, DOT_PRECISION)
    # The rest, up to the tile's last token, crosses the causal diagonal.
    kv_end = prefix_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    acc, l_i, m_i = _attend_kv_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_off,
        num_unmasked, (kv_end + BLOCK_N - 1) // BLOCK_N, kv_end, q_pos, scale_log2, stride_cb, stride_cs,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, True, DOT_PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only; keeps them finite
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


# ----------------------------------------------------------------------------------------
# Decode: split-KV (flash-decoding) + reduce, and cascade (shared-prefix) decode
# ----------------------------------------------------------------------------------------
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
    DOT_DTYPE: tl.constexpr,  # see dot_dtype()
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
    acc, l_i, m_i = _attend_kv_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_off,
        first_tile, first_tile + num_full, kv_len, m_i, scale_log2, stride_cb, stride_cs,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, DOT_PRECISION)
    acc, l_i, m_i = _attend_kv_tiles(  # at most one ragged tile, at the end of the context
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
    for p in range(0, num_stored):
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
    # The arguments up to num_parts are _decode_split_kernel's (_split_launch_args).
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
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:  # value tiles come in _value_column_order
        acc = _value_column_order(acc, BLOCK_M, HEAD_DIM)
    for t in range(first_tile, last_tile):
        offs_n = t * BLOCK_N + col_token
        valid = offs_n < kv_len
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=valid, other=0)
        kv_offs = block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + col_head_off
        kv_ptrs = kv_offs[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(own_head & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # online softmax, as in _attend_kv_tiles
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
            v = _load_e4m3_value_tile(v_cache_ptr, kv_offs, valid, HEADS * BLOCK_N, HEAD_DIM, True).to(DOT_DTYPE)
        else:
            v = tl.load(v_cache_ptr + kv_ptrs, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
        acc = _dim_order(acc, BLOCK_M, HEAD_DIM)

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


# ----------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------
def _check_inputs(q, k_cache, v_cache, block_tables):
    assert q.dim() == 3, f"q must be [N, Hq, D], got shape {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]")
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must have the same strides"
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"head_dim must be a power of two >= 16 (64, 128, 256...), got {head_dim}")
    assert block_size >= 8 and block_size & (block_size - 1) == 0, (
        f"block_size must be a power of two >= 8, got {block_size}")
    assert num_q_heads % num_kv_heads == 0, (
        f"query heads {num_q_heads} must be a multiple of KV heads {num_kv_heads}")
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn), (
        f"the KV cache ({k_cache.dtype}, {v_cache.dtype}) must hold q's dtype ({q.dtype}) or float8_e4m3fn")
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {q.dtype}"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "the head_dim axis must be contiguous"
    assert block_tables.dtype == torch.int32, "block_tables must be int32"
    return num_q_heads, num_kv_heads, head_dim, block_size


# Query chunks up to this long take the mixed kernel's short-prompt tiles (mixed_config).
SHORT_PROMPT_TOKENS = 1024


def _launch_options(q: torch.Tensor, k_cache: torch.Tensor, cfg: dict) -> dict:
    """The keyword arguments every attention launch ends with: the dots' dtype and precision,
    PDL, and the tiles' warps and stages."""
    return dict(DOT_DTYPE=dot_dtype(q.dtype, k_cache.dtype), DOT_PRECISION=dot_precision(q.dtype),
                **pdl_options(q.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def mixed_config(head_dim: int, dtype: torch.dtype, gqa: int, max_query_len: int | None = None) -> dict:
    """Tile sizes for the mixed kernel: BLOCK_M = BLOCK_Q * GQA_PAD query rows per program.

    Shared memory per program is ~ (BLOCK_M + 2 * stages * BLOCK_N) * D * bytes and must
    stay under the H100/H200's 227 KB. The bf16/fp16 D <= 128 tiles were tuned on an H200
    (bf16, D=128): on an 8192-token causal prompt, and, for steps whose query chunks are at
    most SHORT_PROMPT_TOKENS long (max_query_len), on a 1,024-token prompt and on a step of
    W1's prompts. Short chunks leave each program only a few key tiles: smaller tiles give
    more programs and less masked work in the causal triangle.
    """
    elt = dtype.itemsize
    row_bytes = head_dim * elt
    if elt == 2 and head_dim <= 128:  # bf16/fp16, D <= 128: 164 KB at D=128 (80 KB short)
        short = max_query_len is not None and max_query_len <= SHORT_PROMPT_TOKENS
        block_m, block_n, warps, stages = (64, 64, 4, 2) if short else (128, 128, 8, 2)
    elif row_bytes <= 512:  # bf16 D=256, fp32 D<=128
        block_m, block_n, warps, stages = 64, 32, 4, 2
    else:  # fp32 D=256
        block_m, block_n, warps, stages = 32, 16, 4, 2
    gqa_pad = next_power_of_2(gqa)
    block_q = max(1, block_m // gqa_pad)
    return dict(BLOCK_Q=block_q, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def paged_attention_mixed(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: dict | None = None,
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
    tiles, see mixed_config). `config` overrides mixed_config() (keys BLOCK_Q, BLOCK_N,
    num_warps, num_stages).
    """
    num_q_heads, num_kv_heads, head_dim, block_size = _check_inputs(q, k_cache, v_cache, block_tables)
    num_tokens = q.shape[0]
    assert query_start_loc.shape == (seq_lens.shape[0] + 1,), "query_start_loc must be [B + 1]"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0] - first_seq
    if num_tokens == 0 or num_seqs <= 0:
        return out
    gqa = num_q_heads // num_kv_heads
    cfg = mixed_config(head_dim, q.dtype, gqa, max_query_len) if config is None else config
    block_q = cfg["BLOCK_Q"]
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
        BLOCK_N=cfg["BLOCK_N"],
        **_launch_options(q, k_cache, cfg),
    )
    return out


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


def decode_config(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype, num_seqs: int) -> dict:
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
    the loads and the tensor cores): {"fp8_decode": True}, aiming for fp8_decode.SPLIT_WAVES
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
        return dict(fp8_decode=True, programs_per_sm=fp8_decode.PROGRAMS_PER_SM, waves=fp8_decode.SPLIT_WAVES,
                    few_contexts=fp8_decode.FEW_CONTEXTS_WAVES, few_contexts_waves=fp8_decode.FEW_CONTEXTS_SPLIT_WAVES)
    one_wave = {"waves": 1.0, "few_contexts": (0.0, 0.0), "few_contexts_waves": 1.0}
    if cache_dtype == torch.float8_e4m3fn and head_dim <= 128:
        return dict(BLOCK_N=32, num_warps=1, num_stages=5, programs_per_sm=FP8_DECODE_ONE_WARP_PROGRAMS_PER_SM,
                    **one_wave)
    row_bytes = head_dim * dtype.itemsize
    if row_bytes > 512:
        tiles = dict(BLOCK_N=16, num_warps=4, num_stages=2)
    elif row_bytes > 256:
        tiles = dict(BLOCK_N=32, num_warps=4, num_stages=3)
    elif num_seqs >= DECODE_SHORT_TILE_MIN_SEQS or num_seqs == 1:
        tiles = dict(BLOCK_N=64, num_warps=2, num_stages=2)
    else:
        tiles = dict(BLOCK_N=128, num_warps=4, num_stages=2)
    return tiles | {"programs_per_sm": DECODE_PROGRAMS_PER_SM} | one_wave


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


def decode_num_splits_for(config: dict, num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                          max_splits: int = DECODE_MAX_SPLITS) -> int:
    """decode_num_splits for a launch with decode_config's `config` (its programs an SM and waves)."""
    return decode_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, config["programs_per_sm"], max_splits,
                             config["waves"], config["few_contexts"], config["few_contexts_waves"])


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
    config: dict | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, Hq, D] holds one new token per sequence (row b = sequence b),
    at position seq_lens[b] - 1, attending to cached tokens 0 .. seq_lens[b] - 1 (its own
    K/V must already be stored). seq_lens[b] == 0 (a padded row) gives zeros.

    num_splits: programs per (sequence, KV head); pick it with decode_num_splits().
    part_out / part_lse: fp32 workspace with at least B * Hq * num_splits * D and
    B * Hq * num_splits elements (allocated here if None; pass preallocated buffers under
    CUDA graphs). Unused when num_splits == 1.
    """
    num_seqs, num_q_heads, head_dim = _check_decode_inputs(q, k_cache, v_cache, seq_lens, block_tables)
    assert num_splits >= 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    cfg = decode_config(head_dim, q.dtype, k_cache.dtype, num_seqs) if config is None else config
    if num_splits > 1:
        part_out, part_lse = _decode_workspace(part_out, part_lse, num_seqs * num_q_heads * num_splits, q)
    else:
        part_out = part_lse = out  # not touched by the kernel when num_parts == 1
    if cfg.get("fp8_decode"):
        fp8_decode.launch_fp8_decode(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                                     scale * LOG2E, num_splits)
    else:
        _launch_decode_split(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                             DECODE_PLAIN, None, scale, num_splits, 0, num_splits, cfg)
    if num_splits > 1:
        _launch_decode_reduce(part_out, part_lse, out, num_splits)
    return out


def _check_decode_inputs(q, k_cache, v_cache, seq_lens, block_tables) -> tuple[int, int, int]:
    """_check_inputs, plus one query row per sequence. Returns (B, Hq, D)."""
    num_q_heads, _, head_dim, _ = _check_inputs(q, k_cache, v_cache, block_tables)
    num_seqs = seq_lens.shape[0]
    assert q.shape[0] == num_seqs, (
        f"decode expects one query row per sequence: q has {q.shape[0]} rows, {num_seqs} sequences")
    return num_seqs, num_q_heads, head_dim


def _decode_workspace(part_out, part_lse, rows: int, q: torch.Tensor):
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


def _split_launch_args(
    q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
    prefix_blocks: torch.Tensor | None,  # [1] int32 on the device: the shared prefix's blocks (cascade)
    scale: float,
    num_splits: int,
    part_offset: int,  # this launch's splits are workspace parts part_offset..
    num_parts: int,
) -> tuple:
    """The leading arguments of _decode_split_kernel and _own_keys_kernel (the same in both),
    in order. (Positional: a launch's Python cost is paid by every eager step.)"""
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


def _launch_decode_split(
    q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
    mode: int,  # DECODE_PLAIN or DECODE_SHARED_PREFIX
    prefix_blocks: torch.Tensor | None,  # [1] int32 on the device: the shared prefix's blocks (cascade)
    scale: float,
    num_splits: int,
    part_offset: int,
    num_parts: int,
    cfg: dict,
) -> None:
    """One launch of _decode_split_kernel (plain decode or the cascade's prefix)."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    gqa = num_q_heads // num_kv_heads
    if mode == DECODE_SHARED_PREFIX:  # tiles of BLOCK_M (sequence, head) rows over all sequences
        block_m = cfg["BLOCK_M"]
        num_row_tiles = cdiv(num_seqs * gqa, block_m)
    else:  # one sequence's GQA group per program, padded to a power of two >= 16 (tl.dot's M)
        block_m = max(16, next_power_of_2(gqa))
        num_row_tiles = num_seqs
    _decode_split_kernel[(num_kv_heads, num_splits, num_row_tiles)](
        *_split_launch_args(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                            prefix_blocks, scale, num_splits, part_offset, num_parts),
        num_seqs,
        GQA=gqa,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg["BLOCK_N"],
        MODE=mode,
        **_launch_options(q, k_cache, cfg),
    )


def _launch_own_keys(
    q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
    prefix_blocks: torch.Tensor,  # [1] int32 on the device: the shared prefix's blocks
    scale: float,
    num_splits: int,
    part_offset: int,  # the prefix launch's parts per row
    num_parts: int,
    cfg: dict,
) -> None:
    """The cascade's own-keys launch (_own_keys_kernel)."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    gqa = num_q_heads // num_kv_heads
    heads = cfg["HEADS"]
    assert num_kv_heads % heads == 0, f"HEADS={heads} must divide the {num_kv_heads} KV heads"
    _own_keys_kernel[(num_kv_heads // heads, num_splits, num_seqs)](
        *_split_launch_args(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                            prefix_blocks, scale, num_splits, part_offset, num_parts),
        GQA=gqa,
        HEADS=heads,
        BLOCK_M=max(16, next_power_of_2(heads * gqa)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg["BLOCK_N"],
        **_launch_options(q, k_cache, cfg),
    )


def _launch_decode_reduce(part_out, part_lse, out, num_parts: int) -> None:
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


# ----------------------------------------------------------------------------------------
# Cascade decode: a prefix shared by the whole batch is read once per tile of queries
# ----------------------------------------------------------------------------------------
# The prefix launch is compute-shaped (BLOCK_M x BLOCK_N tiles on tensor cores, K/V mostly
# from L2) and its bf16 tiles take ~160 KB of shared memory, one program per SM: so at most
# one wave of programs. A second, partial wave costs a whole program's time, and more splits
# add workspace traffic (checked on W3's decode step: benchmarks/kernels/cascade_attention.py
# --sweep).
PREFIX_MIN_TOKENS_PER_SPLIT = 256


def shared_prefix_config(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype, num_rows: int) -> dict:
    """Tiles for the shared-prefix launch over a cache of `cache_dtype`: the mixed kernel's
    (the same many-rows x keys work), with BLOCK_M cut down to the rows there are (num_rows =
    B * GQA per KV head), except that a 16-bit cache at D <= 128 takes 64-key tiles in three
    stages: the launch is one wave whose programs see only a few key tiles each. Tuned on
    W3's decode step on an H200 (benchmarks/kernels/cascade_attention.py --sweep), where the
    shorter tiles won over 16-bit caches and lost over FP8 ones."""
    cfg = mixed_config(head_dim, dtype, 1)  # GQA 1: BLOCK_Q is then the whole row tile
    block_m = min(cfg["BLOCK_Q"], max(16, next_power_of_2(num_rows)))
    short_tiles = cache_dtype.itemsize == 2 and head_dim <= 128
    block_n, stages = (64, 3) if short_tiles else (cfg["BLOCK_N"], cfg["num_stages"])
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": cfg["num_warps"], "num_stages": stages}


# The own-keys launch's KV heads per program (at most; the largest power of two that divides
# the model's KV heads).
OWN_KEYS_MAX_HEADS = 4


def own_keys_config(head_dim: int, dtype: torch.dtype, num_kv_heads: int) -> dict:
    """Tiles for the cascade's own-keys launch (_own_keys_kernel): HEADS KV heads per program,
    key tiles of 64 rows at D=128 (HEADS * the tile's tokens; 16 KB of 16-bit keys), three stages.
    Tuned on W3's decode step (256 sequences of 64-192 own tokens, bf16, D=128, 8 KV heads,
    H200): 4 heads x 16 tokens beat 8 x 8, 8 x 16, 2 x 32 and the one-head programs of
    _decode_split_kernel (benchmarks/kernels/cascade_attention.py --sweep)."""
    heads = OWN_KEYS_MAX_HEADS
    while num_kv_heads % heads:
        heads //= 2
    key_rows = max(16, min(64, 16384 // (head_dim * dtype.itemsize)))
    return {"HEADS": heads, "BLOCK_N": max(1, key_rows // heads), "num_warps": 4, "num_stages": 3}


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
    prefix_config: dict | None = None,
    suffix_config: dict | None = None,
) -> torch.Tensor:
    """Decode attention (as paged_attention_decode) for a batch whose sequences all start
    with the same P blocks, P = num_prefix_blocks[0] (a 1-element int32 tensor on the
    device): block_tables[b, :P] == block_tables[0, :P] for every b, and seq_lens[b] >=
    P * block_size + 1 (at least one own token: the new one) for every b with seq_lens[b] > 0.

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
    num_seqs, num_q_heads, head_dim = _check_decode_inputs(q, k_cache, v_cache, seq_lens, block_tables)
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
    part_out, part_lse = _decode_workspace(part_out, part_lse, num_seqs * num_q_heads * num_parts, q)
    _launch_decode_split(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
                         DECODE_SHARED_PREFIX, num_prefix_blocks, scale, prefix_splits, 0, num_parts,
                         prefix_config)
    _launch_own_keys(q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables, num_prefix_blocks,
                     scale, suffix_splits, prefix_splits, num_parts, suffix_config)
    if suffix_splits > 1:  # with one split, the suffix launch has merged (see the kernel)
        _launch_decode_reduce(part_out, part_lse, out, num_parts)
    return out
