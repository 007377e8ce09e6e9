"""Would a persistent decode-attention kernel over a length-ordered work list beat the engine's
split-KV launch on W1's batches? (A probe for a design question; its kernel is not the engine's.)

The engine's decode launch gives every (sequence, KV head) the same number of splits, fixed
when the CUDA graph is captured; on W1's ragged contexts it reaches 3.87 TB/s on average
(benchmarks/decode_w1.py) against 4.0-4.19 on equal contexts, and 2-3.5 TB/s below ~56
sequences. Here the host cuts every context into chunks of at most CHUNK tokens, lists the
(sequence, KV head, chunk) items longest first, and a fixed grid of PROGRAMS_PER_SM programs per
SM takes items i, i + P, i + 2P, ...: no tail of a late long context, no split count frozen in
the graph, and long contexts of small batches still spread over the whole GPU. A sequence
cut into several chunks has them merged by a reduce launch, as the engine's splits are. The
chunk length is read on the device, so it can follow the batch: fixed (256, 512, 1,024
tokens), or chosen per batch for about 2, 4 or 8 items per program ("adaptive"). "K/V reads
alone" streams the same pages without attending (the first variant's work list): the floor
for any kernel that reads them in that order.

    python benchmarks/persistent_decode_probe.py [--every 64]     # GPU: time it on W1's batches
    TRITON_INTERPRET=1 python benchmarks/persistent_decode_probe.py --check   # CPU: correctness only
"""

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, uninstalled
from benchmarks.common import DEFAULT_MAX_MODEL_LEN, shuffled_block_tables  # noqa: E402
from benchmarks.decode_w1 import HKV, HQ, D, build_layers, w1_decode_batches  # noqa: E402
from minivllm.executor.cuda_graphs import graph_batch_sizes  # noqa: E402
from minivllm.kernels import dot_precision, sm_count  # noqa: E402
from minivllm.kernels import paged_attention as pa  # noqa: E402
from minivllm.kernels.paged_attention import LOG2E, _attend_kv_tiles  # noqa: E402, F401 (used by the kernel)


@triton.jit
def _persistent_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_out_ptr,  # [B, Hq, max_chunks, D] fp32: each chunk's normalised output
    part_lse_ptr,  # [B, Hq, max_chunks] fp32: each chunk's log2-sum-exp2
    seq_lens_ptr, block_tables_ptr,
    items_ptr,  # [>= num_items] int32: (seq * num_kv_heads + kv_head) * max_chunks + chunk, longest first
    num_items_ptr,  # [1] int32
    chunk_len_ptr,  # [1] int32: tokens per chunk, a multiple of BLOCK_N (this step's choice)
    scale_log2,
    num_kv_heads, max_chunks,
    stride_qn, stride_qh,
    stride_on, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    GQA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_items = tl.load(num_items_ptr)
    chunk_len = tl.load(chunk_len_ptr)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GQA
    offs_d = tl.arange(0, HEAD_DIM)
    for i in range(tl.program_id(0), num_items, tl.num_programs(0)):
        item = tl.load(items_ptr + i)
        chunk = item % max_chunks
        kv_head = (item // max_chunks) % num_kv_heads
        seq = item // (max_chunks * num_kv_heads)
        head = kv_head * GQA + rows
        kv_len = tl.load(seq_lens_ptr + seq)
        num_keys = tl.minimum(kv_len - chunk * chunk_len, chunk_len)
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_valid[:, None], other=0.0)
        block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        first_tile = chunk * (chunk_len // BLOCK_N)
        num_full = num_keys // BLOCK_N
        acc, l_i, m_i = _attend_kv_tiles(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head * stride_ch,
            first_tile, first_tile + num_full, kv_len, m_i, scale_log2, stride_cb, stride_cs,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, DOT_PRECISION)
        acc, l_i, m_i = _attend_kv_tiles(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head * stride_ch,
            first_tile + num_full, first_tile + (num_keys + BLOCK_N - 1) // BLOCK_N, kv_len, m_i,
            scale_log2, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, False, DOT_PRECISION)
        out = acc / l_i[:, None]  # every item has at least one key
        if kv_len <= chunk_len:  # the only chunk: the final output
            tl.store(out_ptr + seq.to(tl.int64) * stride_on + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        else:
            part = (seq * (num_kv_heads * GQA) + head) * max_chunks + chunk
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_valid[:, None])
            tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_valid)


@triton.jit
def _stream_kv_kernel(k_cache_ptr, v_cache_ptr, sink_ptr, seq_lens_ptr, block_tables_ptr, items_ptr,
                      num_items_ptr, chunk_len_ptr, num_kv_heads, max_chunks, stride_cb, stride_cs, stride_ch,
                      stride_bt, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # The memory side alone: the persistent kernel's loads of every item's K and V, summed
    # instead of attended (the sum is stored so that the loads stay). Its time is the floor
    # for any attention kernel reading these pages in this order.
    num_items = tl.load(num_items_ptr)
    chunk_len = tl.load(chunk_len_ptr)
    offs_d = tl.arange(0, HEAD_DIM)
    total = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for i in range(tl.program_id(0), num_items, tl.num_programs(0)):
        item = tl.load(items_ptr + i)
        chunk = item % max_chunks
        kv_head = (item // max_chunks) % num_kv_heads
        seq = item // (max_chunks * num_kv_heads)
        kv_len = tl.load(seq_lens_ptr + seq)
        first_key = chunk * chunk_len
        end_key = tl.minimum(first_key + chunk_len, kv_len)
        for start in range(first_key, end_key, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < end_key
            block_ids = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + offs_n // BLOCK_SIZE,
                                mask=valid, other=0)
            ptrs = (block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs
                    + kv_head * stride_ch)[:, None] + offs_d[None, :]
            total += tl.load(k_cache_ptr + ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
            total += tl.load(v_cache_ptr + ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(sink_ptr + tl.program_id(0), tl.sum(tl.sum(total, 1), 0))


@triton.jit
def _merge_chunks_kernel(part_out_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, chunk_len_ptr, max_chunks,
                         stride_on, stride_oh, num_q_heads,
                         HEAD_DIM: tl.constexpr, MAX_CHUNKS_POW2: tl.constexpr):
    # One program per (sequence, query head) cut into several chunks: the chunks' outputs
    # weighted by 2 ** (lse - max lse).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    chunk_len = tl.load(chunk_len_ptr)
    num_chunks = (tl.load(seq_lens_ptr + seq) + chunk_len - 1) // chunk_len
    if num_chunks > 1:
        c = tl.arange(0, MAX_CHUNKS_POW2)
        valid = c < num_chunks
        part = (seq * num_q_heads + head) * max_chunks + c
        lse = tl.load(part_lse_ptr + part, mask=valid, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))
        o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :],
                    mask=valid[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + seq.to(tl.int64) * stride_on + head * stride_oh + tl.arange(0, HEAD_DIM),
                 out.to(out_ptr.dtype.element_ty))


def work_items(seq_lens: list[int], num_kv_heads: int, chunk: int, max_chunks: int) -> np.ndarray:
    """The (sequence, KV head, chunk) items of a batch, longest chunk first (host work, as
    the runner would do it in prepare_inputs); empty sequences have none."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    chunks = -(-lens // chunk)
    seq = np.repeat(np.arange(len(lens)), chunks)
    index = np.arange(len(seq)) - np.repeat(np.cumsum(chunks) - chunks, chunks)  # chunk within its sequence
    length = np.minimum(lens[seq] - index * chunk, chunk)
    order = np.argsort(-length, kind="stable")
    seq, index = seq[order], index[order]
    heads = np.arange(num_kv_heads)
    items = ((seq[:, None] * num_kv_heads + heads[None, :]) * max_chunks + index[:, None]).reshape(-1)
    return items.astype(np.int32)


ADAPTIVE_MIN_CHUNK = 128  # tokens; an adaptive chunk is a multiple of 64 (the bf16 key tile)


class PersistentDecode:
    """The probe's decode attention: buffers sized for max_num_seqs sequences of up to
    max_model_len tokens, so one CUDA graph serves any lengths. chunk: tokens per chunk, or
    None to choose it per batch so that each program gets about items_per_program items."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, max_num_seqs: int, max_model_len: int,
                 chunk: int | None, programs_per_sm: int, device: torch.device, items_per_program: int = 4) -> None:
        self.num_kv_heads, self.chunk, self.items_per_program = num_kv_heads, chunk, items_per_program
        self.max_model_len = max_model_len
        self.min_chunk = ADAPTIVE_MIN_CHUNK if chunk is None else chunk
        self.max_chunks = triton.cdiv(max_model_len, self.min_chunk)
        self.num_programs = programs_per_sm * sm_count(device)
        self.items = torch.zeros(max_num_seqs * num_kv_heads * self.max_chunks, dtype=torch.int32, device=device)
        self.num_items = torch.zeros(1, dtype=torch.int32, device=device)
        self.chunk_len = torch.zeros(1, dtype=torch.int32, device=device)
        rows = max_num_seqs * num_q_heads * self.max_chunks
        self.part_out = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(rows, dtype=torch.float32, device=device)

    def chunk_for(self, seq_lens: list[int]) -> int:
        if self.chunk is not None:
            return self.chunk
        want = self.num_kv_heads * sum(seq_lens) / (self.num_programs * self.items_per_program)
        return min(max(ADAPTIVE_MIN_CHUNK, -(-int(want) // 64) * 64), -(-self.max_model_len // 64) * 64)

    def set_lengths(self, seq_lens: list[int]) -> int:
        """Upload a batch's chunk length and work list (what a step's input preparation would
        do); returns the chunk length."""
        chunk = self.chunk_for(seq_lens)
        items = work_items(seq_lens, self.num_kv_heads, chunk, self.max_chunks)
        self.items[:len(items)] = torch.from_numpy(items).to(self.items.device)
        self.num_items.fill_(len(items))
        self.chunk_len.fill_(chunk)
        return chunk

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        num_seqs, num_q_heads, head_dim = q.shape
        gqa = num_q_heads // self.num_kv_heads
        cfg = pa.decode_config(head_dim, q.dtype)
        block_n = min(cfg["BLOCK_N"], self.min_chunk)  # every chunk length is a multiple of it
        _persistent_decode_kernel[(self.num_programs,)](
            q, k_cache, v_cache, out, self.part_out, self.part_lse, seq_lens, block_tables,
            self.items, self.num_items, self.chunk_len, scale * LOG2E, self.num_kv_heads, self.max_chunks,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GQA=gqa, BLOCK_M=max(16, triton.next_power_of_2(gqa)), HEAD_DIM=head_dim,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
            DOT_PRECISION=dot_precision(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        _merge_chunks_kernel[(num_seqs, num_q_heads)](
            self.part_out, self.part_lse, out, seq_lens, self.chunk_len, self.max_chunks, out.stride(0),
            out.stride(1), num_q_heads, HEAD_DIM=head_dim,
            MAX_CHUNKS_POW2=triton.next_power_of_2(self.max_chunks), num_warps=4)
        return out


def stream_only(probe: "PersistentDecode", k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, sink: torch.Tensor) -> None:
    """_stream_kv_kernel over the probe's current work list."""
    _stream_kv_kernel[(probe.num_programs,)](
        k_cache, v_cache, sink, seq_lens, block_tables, probe.items, probe.num_items, probe.chunk_len,
        probe.num_kv_heads, probe.max_chunks, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), HEAD_DIM=k_cache.shape[-1], BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=min(64, probe.min_chunk), num_warps=4, num_stages=3)


def check(device: torch.device) -> None:
    """The probe's kernels against the engine's decode launch, on small ragged batches."""
    gen = random.Random(0)
    hq, hkv, d, block = 4, 2, 32, 8
    for seq_lens, chunk in (([1, 5, 16, 17, 40, 33], 16), ([100, 3, 64], 32), ([0, 7, 0, 70], 16),
                            ([300, 129, 5, 128], 128),  # chunks of two 64-key tiles
                            ([500, 129, 5, 300], None)):  # a chunk for ~4 items per program (4 on a CPU)
        need = [triton.cdiv(max(1, s), block) for s in seq_lens]
        table = shuffled_block_tables(need, gen).to(device)
        k_cache = torch.randn(sum(need), block, hkv, d, device=device)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(len(seq_lens), hq, d, device=device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        want = pa.paged_attention_decode(q, k_cache, v_cache, lens, table, d ** -0.5, 1)
        probe = PersistentDecode(hq, hkv, d, len(seq_lens), 512, chunk, 1, device)
        chunk = probe.set_lengths(seq_lens)
        got = probe(q, k_cache, v_cache, lens, table, d ** -0.5, torch.zeros_like(q))
        nonempty = lens > 0
        torch.testing.assert_close(got[nonempty], want[nonempty], atol=1e-4, rtol=1e-4)
        # The reads-only kernel reads exactly every cached K and V of the batch.
        sink = torch.zeros(probe.num_programs, device=device)
        stream_only(probe, k_cache, v_cache, lens, table, sink)
        blocks = [table[b, :triton.cdiv(n, block)] for b, n in enumerate(seq_lens)]
        want_sum = sum(float(cache[ids].flatten(0, 1)[:n].sum()) for ids, n in zip(blocks, seq_lens)
                       for cache in (k_cache, v_cache))
        assert abs(float(sink.sum()) - want_sum) < 1e-3 * (1 + abs(want_sum)), (float(sink.sum()), want_sum)
        print(f"ok: lengths {seq_lens}, chunk {chunk}")


def time_step(seq_lens: list[int], probes: dict, gen: random.Random) -> dict:
    """Seconds per layer of the engine's decode launch and of each probe, on one W1 batch
    padded to its graph size (K/V from HBM: several layers' caches in turn)."""
    device = torch.device("cuda")
    padded = next(s for s in graph_batch_sizes(256) if s >= len(seq_lens))
    lens = seq_lens + [0] * (padded - len(seq_lens))
    layers = build_layers([max(1, s) for s in lens], gen)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(padded, HQ, D, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    splits = pa.decode_num_splits(padded, HKV, DEFAULT_MAX_MODEL_LEN, sm_count(device))
    part_out = torch.empty(padded * HQ * splits * D, dtype=torch.float32, device=device)
    part_lse = torch.empty(padded * HQ * splits, dtype=torch.float32, device=device)

    def engine() -> None:
        for k, v, table in layers:
            pa.paged_attention_decode(q, k, v, lens_dev, table, D ** -0.5, splits, out=out,
                                      part_out=part_out, part_lse=part_lse)

    def persistent(probe: PersistentDecode) -> None:
        for k, v, table in layers:
            probe(q, k, v, lens_dev, table, D ** -0.5, out)

    floor_probe = next(iter(probes.values()))
    sink = torch.empty(floor_probe.num_programs, dtype=torch.float32, device=device)

    def stream() -> None:
        for k, v, table in layers:
            stream_only(floor_probe, k, v, lens_dev, table, sink)

    seconds = {}
    reference = None
    for name, run in [("engine", engine), *((v, lambda p=p: persistent(p)) for v, p in probes.items())]:
        if name != "engine":
            probes[name].set_lengths(lens)
        run()
        if reference is None:
            reference = out[:len(seq_lens)].clone()
        torch.testing.assert_close(out[:len(seq_lens)], reference, atol=2e-2, rtol=2e-2)
        seconds[name] = triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median") * 1e-3 / len(layers)
    floor_probe.set_lengths(lens)
    stream()
    seconds["K/V reads alone"] = triton.testing.do_bench_cudagraph(stream, rep=60, return_mode="median") * 1e-3 / len(layers)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=64, help="time every this many'th decode step of W1")
    parser.add_argument("--check", action="store_true", help="only compare with the engine's kernel (CPU or GPU)")
    args = parser.parse_args()
    if args.check:
        check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return
    if not torch.cuda.is_available():
        sys.exit("timing needs a CUDA GPU (--check runs on CPU under TRITON_INTERPRET=1)")
    check(torch.device("cuda"))
    device = torch.device("cuda")
    probes = {f"chunk {chunk}, {per_sm}/SM": PersistentDecode(HQ, HKV, D, 256, DEFAULT_MAX_MODEL_LEN, chunk, per_sm,
                                                              device)
              for chunk in (256, 512, 1024) for per_sm in (3, 4)}
    probes |= {f"adaptive, {ipp} items/program": PersistentDecode(HQ, HKV, D, 256, DEFAULT_MAX_MODEL_LEN, None, 4,
                                                                  device, items_per_program=ipp)
               for ipp in (2, 4, 8)}
    totals = dict.fromkeys(["engine", *probes, "K/V reads alone"], 0.0)
    gen = random.Random(0)
    for step, seq_lens in w1_decode_batches(args.every):
        seconds = time_step(sorted(seq_lens, reverse=True), probes, gen)  # decodes as the runner orders them
        layer_bytes = sum(seq_lens) * HKV * D * 2 * 2
        for name, t in seconds.items():
            totals[name] += t * 28 * args.every  # 28 layers; this step stands for `every` steps
        print(f"step {step:4d} batch {len(seq_lens):3d}: " + " | ".join(
            f"{name}: {t * 1e6:6.1f} us {layer_bytes / t / 1e12:4.2f} TB/s" for name, t in seconds.items()), flush=True)
    print("\nW1 decode attention, estimated from these steps (28 layers):")
    for name, seconds in totals.items():
        print(f"  {name:38s} {seconds:6.3f} s")


if __name__ == "__main__":
    main()
