"""Decode attention over an FP8 (e4m3) KV cache, in Gluon (Triton's layout-explicit dialect).

The same computation as decode_attention.py's split-KV decode (one program per (KV head, split,
sequence), partial results merged by its reduce kernel), laid out so that an e4m3 tile costs
few instructions and no shared-memory round trip between its load and the tensor cores:

* keys-major: S^T = K Q^T and O^T += V^T P^T, so the tile's 32 keys (and V's 128 dims) are
  mma's M and the GQA group's query rows its N, padded to 8 rather than to 16;
* K and V go from global to shared memory by cp.async, three tiles in flight, as 4-byte words
  in a swizzled layout from which each lane reads back only the words it copied (16-byte
  loads, no bank conflicts, no barrier: the program is one warp);
* the dims of Q.K (the dot's reduction axis, any order) are permuted so that each lane's
  share of a K row is 32 consecutive bytes, and V's dims (O's rows, put back at the store)
  so that each lane's share of a V row is 16 consecutive bytes; widened in registers by
  cvt.rn.f16x2.e4m3x2 straight into the mma operands (for V after pairing two keys' bytes
  with one prmt, as mma packs two consecutive keys per register).

fp16 dots as attention_tiles.dot_dtype gives for FP8 caches: every e4m3 value is exact in
fp16. Gluon kernels do not run under Triton's interpreter: the CPU tests take
decode_attention.py's Triton kernel (decode_config chooses), the GPU tests this one.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from minivllm.kernels.common import E4M3_WORD_TO_FP16_PTX, next_power_of_2
from minivllm.kernels.pdl import pdl_options

BLOCK_N = gl.constexpr(32)  # keys a tile
HEAD_DIM = gl.constexpr(128)
STAGES = gl.constexpr(3)  # tiles in shared memory: two in flight while one is read
PROGRAMS_PER_SM = 9  # 3 x 8 KB of K/V tiles a program: 9 fit an SM's shared memory
# A launch of fewer contexts than about one wave of programs (PROGRAMS_PER_SM an SM) splits
# them into this many waves (decode_attention.decode_num_splits): in a single wave the SMs'
# one-warp programs end unevenly (contexts differ in length) and leave the SMs ever less
# to stream. Contexts that fill a fraction of a wave within FEW_CONTEXTS_WAVES are split into
# FEW_CONTEXTS_SPLIT_WAVES waves: more splits there shorten each program's stream more than
# they even out the launch's end (W1's decode steps of 45-93 sequences, in the engine's graphs;
# at 19 sequences 2.5 waves stay faster).
SPLIT_WAVES = 2.5
FEW_CONTEXTS_WAVES = (0.25, 0.65)
FEW_CONTEXTS_SPLIT_WAVES = 1.6

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(0, MMA, 2))
B_OP = gl.constexpr(gl.DotOperandLayout(1, MMA, 2))
# K [keys, 4-byte words]: a lane holds 8 consecutive words (32 dims) of 4 keys.
K_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0], [16, 0]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[32, 32]))
# V [keys, 4-byte words]: a lane holds 4 consecutive words (16 dims) of 8 keys.
V_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]], warp_bases=[], block_bases=[], shape=[32, 32]))
# 16-byte chunks XOR-swizzled by row: the 8 lanes of a load phase meet 8 different bank groups.
TILE_SMEM = gl.constexpr(gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
ROWS = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0]))  # out's [rows, dims]


@gluon.jit
def _widen(w):
    """[rows, 32] words of e4m3 bytes -> [rows, 128] fp16 (byte b of word i is dim 4 i + b)."""
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        asm=E4M3_WORD_TO_FP16_PTX,
        constraints="=h,=h,=h,=h,r", args=[w], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=1)
    return gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [w.shape[0], HEAD_DIM])


@gluon.jit
def _widen_key_pairs(w):
    """[rows, 32] words of e4m3 bytes -> [rows, 128] fp16 whose registers pair rows 2i and
    2i + 1 (P.V's operand packs two keys of one dim): the two rows' bytes interleaved by prmt,
    then widened."""
    rows: gl.constexpr = w.shape[0]
    we, wo = gl.split(gl.permute(gl.reshape(w, [rows // 2, 2, 32]), (0, 2, 1)))
    e0, o0, e1, o1, e2, o2, e3, o3 = gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x, y, a, b, c, d;
        .reg .b16 xl, xh, yl, yh;
        prmt.b32 x, $8, $9, 0x5140;
        prmt.b32 y, $8, $9, 0x7362;
        mov.b32 {xl, xh}, x;
        mov.b32 {yl, yh}, y;
        cvt.rn.f16x2.e4m3x2 a, xl;
        cvt.rn.f16x2.e4m3x2 b, xh;
        cvt.rn.f16x2.e4m3x2 c, yl;
        cvt.rn.f16x2.e4m3x2 d, yh;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        mov.b32 {$4, $5}, c;
        mov.b32 {$6, $7}, d;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[we, wo],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=1)
    even = gl.join(gl.join(e0, e2), gl.join(e1, e3))  # [.., 2, 2]: byte 2 x + y
    odd = gl.join(gl.join(o0, o2), gl.join(o1, o3))
    v = gl.reshape(gl.join(even, odd), [rows // 2, 32, 4, 2])  # (key pair, word, byte, key parity)
    return gl.reshape(gl.permute(v, (0, 3, 1, 2)), [rows, HEAD_DIM])


@gluon.jit
def _tile_offsets(bt, key_blocks, word_offs, n0, kv_len, in_range, stride_cb_w, stride_cs_w,
                  BLOCK_SIZE: gl.constexpr):
    """The K or V tile of keys n0 .. n0 + BLOCK_N - 1: each key's word offset in the cache,
    and which keys to read (none from kv_len on, none at all unless in_range). bt: the
    sequence's block table row; per key of the tile: key_blocks, its block within the tile,
    and word_offs, its word offset within its block (plus the KV head's)."""
    keys = gl.arange(0, BLOCK_N, layout=word_offs.type.layout)
    valid = (keys < kv_len - n0) & in_range
    if BLOCK_SIZE <= BLOCK_N:
        ids = gl.load(bt + n0 // BLOCK_SIZE + key_blocks, mask=valid, other=0)
        offs = ids * stride_cb_w + word_offs
    else:  # the whole tile in one block
        offs = gl.load(bt + n0 // BLOCK_SIZE) * stride_cb_w + (n0 % BLOCK_SIZE) * stride_cs_w + word_offs
    return offs, valid


@gluon.jit
def _copy_tile(smem, words, offs, valid, dims):
    """cp.async of a tile (_tile_offsets' offs and valid; dims: the words of a row) into smem;
    zeros land for the keys not read."""
    async_copy.async_copy_global_to_shared(smem, words + offs[:, None] + dims[None, :], mask=valid[:, None])


@gluon.jit
def _attend_keys(k_w, keys_left, qt, l_i, m_i, scale_log2):
    """One tile's scores (its keys from keys_left on masked) and the online softmax's update:
    (P^T as P.V's operand, the accumulator's rescale, l, m)."""
    k = _widen(k_w)
    # Q.K's dims in the order q's were put in: d = 32 a + 2 b + c goes to 8 b + 2 a + c.
    k = gl.reshape(gl.permute(gl.reshape(k, [BLOCK_N, 4, 16, 2]), (0, 2, 1, 3)), [BLOCK_N, HEAD_DIM])
    st = mma_v2(gl.convert_layout(k, A_OP), qt, gl.zeros([BLOCK_N, qt.shape[1]], gl.float32, layout=MMA))
    valid = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA)) < keys_left
    st = gl.where(valid[:, None], st * scale_log2, float("-inf"))  # base 2
    m_new = gl.maximum(m_i, gl.max(st, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(st - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, 0)
    return gl.convert_layout(p.to(gl.float16), B_OP), alpha, l_i, m_new


@gluon.jit
def _attend_values(v_w, pt, alpha, acc):
    """acc (O^T, its rows the dims in the order below, undone at the store) rescaled, plus
    V^T P^T. Keys past the context were copied as zeros: p is 0 there, but 0 * NaN would not be."""
    v = _widen_key_pairs(v_w)
    # V's dims d = 16 a + b go to O^T row 8 b + a: each lane's 16 consecutive dims become its rows.
    vt = gl.permute(gl.reshape(gl.permute(gl.reshape(v, [BLOCK_N, 8, 16]), (0, 2, 1)), [BLOCK_N, HEAD_DIM]), (1, 0))
    return mma_v2(gl.convert_layout(vt, A_OP), pt, acc * alpha[None, :])


@gluon.jit(do_not_specialize=["num_splits"])
def _fp8_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,
    out_ptr,  # [B, Hq, D], written directly when num_splits == 1
    part_out_ptr,  # [B, Hq, num_splits, D] fp32: each split's normalised output
    part_lse_ptr,  # [B, Hq, num_splits] fp32: each split's log2-sum-exp2 of scores
    seq_lens_ptr, block_tables_ptr,
    scale_log2,
    num_q_heads,
    stride_qn, stride_qh,
    stride_on, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    num_splits,
    GQA: gl.constexpr,
    QUERY_ROWS: gl.constexpr,  # GQA padded to a power of two >= 8 (mma's N)
    BLOCK_SIZE: gl.constexpr,
    PDL: gl.constexpr,
):
    kv_head = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2)
    kv_len = gl.load(seq_lens_ptr + seq)
    # As decode_attention.py's split kernel: the context shared evenly in whole tiles.
    tiles_per_split = ((kv_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N
    first = split * tiles_per_split
    end = gl.minimum(first + tiles_per_split, (kv_len + BLOCK_N - 1) // BLOCK_N)
    bt = block_tables_ptr + seq.to(gl.int64) * stride_bt
    k_words = k_cache_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    v_words = v_cache_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    stride_cb_w = stride_cb // 4
    stride_cs_w = stride_cs // 4
    head_w = kv_head * (stride_ch // 4)
    keys_k = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, K_WORDS))
    keys_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, V_WORDS))
    dims_k = gl.arange(0, 32, layout=gl.SliceLayout(0, K_WORDS))
    dims_v = gl.arange(0, 32, layout=gl.SliceLayout(0, V_WORDS))
    kb_k = keys_k // BLOCK_SIZE
    kb_v = keys_v // BLOCK_SIZE
    wo_k = (keys_k % BLOCK_SIZE) * stride_cs_w + head_w
    wo_v = (keys_v % BLOCK_SIZE) * stride_cs_w + head_w
    k_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 32], TILE_SMEM)
    v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 32], TILE_SMEM)

    # The first two tiles' block-table entries before the wait (the host writes the block
    # tables, no kernel does), their K and V after it.
    gl.static_assert(STAGES == 3, "the prologue fills two stages")
    k_offs0, k_valid0 = _tile_offsets(bt, kb_k, wo_k, first * BLOCK_N, kv_len, first < end,
                                      stride_cb_w, stride_cs_w, BLOCK_SIZE)
    v_offs0, v_valid0 = _tile_offsets(bt, kb_v, wo_v, first * BLOCK_N, kv_len, first < end,
                                      stride_cb_w, stride_cs_w, BLOCK_SIZE)
    k_offs1, k_valid1 = _tile_offsets(bt, kb_k, wo_k, (first + 1) * BLOCK_N, kv_len, first + 1 < end,
                                      stride_cb_w, stride_cs_w, BLOCK_SIZE)
    v_offs1, v_valid1 = _tile_offsets(bt, kb_v, wo_v, (first + 1) * BLOCK_N, kv_len, first + 1 < end,
                                      stride_cb_w, stride_cs_w, BLOCK_SIZE)
    if PDL:  # the previous kernel writes q and this step's K/V (kernels/pdl.py)
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    _copy_tile(k_smem.index(0), k_words, k_offs0, k_valid0, dims_k)
    _copy_tile(v_smem.index(0), v_words, v_offs0, v_valid0, dims_v)
    async_copy.commit_group()
    _copy_tile(k_smem.index(1), k_words, k_offs1, k_valid1, dims_k)
    _copy_tile(v_smem.index(1), v_words, v_offs1, v_valid1, dims_v)
    async_copy.commit_group()

    # Q^T, loaded straight into its mma operand (a layout conversion would take shared memory
    # beside the tiles'), its dims in the order _attend_keys puts K's in: logical dim
    # 8 b + 2 a + c is d = 32 a + 2 b + c, so that each lane's share of a K row is contiguous.
    dot_dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, B_OP))
    dot_rows = gl.arange(0, QUERY_ROWS, layout=gl.SliceLayout(0, B_OP))
    d = 32 * ((dot_dims >> 1) & 3) + 2 * (dot_dims >> 3) + (dot_dims & 1)
    q_rows = seq.to(gl.int64) * stride_qn + (kv_head * GQA + dot_rows) * stride_qh
    qt = gl.load(q_ptr + q_rows[None, :] + d[:, None], mask=(dot_rows < GQA)[None, :], other=0.0).to(gl.float16)

    m_i = gl.full([QUERY_ROWS], -1.0e30, gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([QUERY_ROWS], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([HEAD_DIM, QUERY_ROWS], gl.float32, layout=MMA)  # O^T
    for t in range(first, end):
        i = t - first
        async_copy.wait_group(STAGES - 2)  # tile t has landed
        k_w = k_smem.index(i % STAGES).load(K_WORDS)
        # Tile t + STAGES - 1 goes into the slot read in the last iteration.
        n0 = (t + STAGES - 1) * BLOCK_N
        slot = (i + STAGES - 1) % STAGES
        k_offs, k_valid = _tile_offsets(bt, kb_k, wo_k, n0, kv_len, t + STAGES - 1 < end,
                                        stride_cb_w, stride_cs_w, BLOCK_SIZE)
        _copy_tile(k_smem.index(slot), k_words, k_offs, k_valid, dims_k)
        v_offs, v_valid = _tile_offsets(bt, kb_v, wo_v, n0, kv_len, t + STAGES - 1 < end,
                                        stride_cb_w, stride_cs_w, BLOCK_SIZE)
        _copy_tile(v_smem.index(slot), v_words, v_offs, v_valid, dims_v)
        async_copy.commit_group()
        pt, alpha, l_i, m_i = _attend_keys(k_w, kv_len - t * BLOCK_N, qt, l_i, m_i, scale_log2)
        acc = _attend_values(v_smem.index(i % STAGES).load(V_WORDS), pt, alpha, acc)

    # l_i == 0 only for an empty split (or seq_len 0, a padded row): zeros, and lse = -inf
    # so that the merge gives it no weight.
    empty = l_i == 0.0
    out = acc / gl.where(empty, 1.0, l_i)[None, :]
    # Back to [rows, dims] in the dims' own order (O^T row 8 b + a is dim 16 a + b).
    out = gl.permute(gl.reshape(gl.permute(out, (1, 0)), [QUERY_ROWS, 16, 8]), (0, 2, 1))
    out = gl.convert_layout(gl.reshape(out, [QUERY_ROWS, HEAD_DIM]), ROWS)
    rows = gl.arange(0, QUERY_ROWS, layout=gl.SliceLayout(1, ROWS))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ROWS))
    row_valid = rows < GQA
    head = kv_head * GQA + rows
    if num_splits == 1:
        o_ptrs = out_ptr + (seq.to(gl.int64) * stride_on + head * stride_oh)[:, None] + dims[None, :]
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = (seq * num_q_heads + head) * num_splits + split
        gl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
        gl.store(part_lse_ptr + part, gl.convert_layout(lse, gl.SliceLayout(1, ROWS)), mask=row_valid)


def supports(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether this kernel serves a decode of `dtype` queries over such a cache (any GQA; any
    block size, a power of two)."""
    return (cache_dtype == torch.float8_e4m3fn and dtype in (torch.bfloat16, torch.float16)
            and head_dim == HEAD_DIM.value)


def launch_fp8_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      part_out: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale_log2: float, num_splits: int) -> None:
    """One launch over the batch (split results into part_out / part_lse when num_splits > 1,
    for decode_attention.py's reduce; else straight into out)."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert supports(head_dim, q.dtype, k_cache.dtype)
    assert k_cache.numel() // 4 < 2 ** 31, "word offsets into the cache are int32"
    gqa = num_q_heads // num_kv_heads
    _fp8_decode_kernel[(num_kv_heads, num_splits, num_seqs)](
        q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
        scale_log2, num_q_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_splits,
        GQA=gqa, QUERY_ROWS=max(8, next_power_of_2(gqa)), BLOCK_SIZE=block_size,
        **pdl_options(q.device), num_warps=1)
