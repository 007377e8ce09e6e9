"""Triton attention backend: paged prefill/mixed attention, split-KV decode.

Same interface as the torch reference backend (torch_backend.py):
    forward(positions, q, k, v, k_cache, v_cache, prologue, meta, scale) -> out
Per layer, forward launches fused_ops.qk_norm_rope_store (the q/k prologue: norms and RoPE,
and the K/V store, in one kernel), then attends (`attend`).

Decode-only steps (meta.max_query_len == 1) take the split-KV decode kernel. Mixed steps
send their leading one-token sequences (meta.num_leading_decodes: the runner puts decodes
first, executor/persistent_batch.StepRows) to the decode kernel too, and the rest to the
mixed kernel. Both are CUDA-graph capturable: launch sizes come from tensor shapes and
meta.max_seq_len only (under graphs pass max_model_len as max_seq_len), real lengths are
read from meta.seq_lens on the device.

Decodes (of a decode-only or a mixed step) that all begin with the same blocks take the
cascade kernels when the runner sets meta.num_shared_prefix_blocks: the shared prefix is read
once per tile of queries instead of once per sequence. Also capturable: the prefix length is
read on the device, split counts follow meta.max_seq_len.

What each kind of step launches per layer (kernels/decode_attention.py, cascade_attention.py
and mixed_attention.py; the graph kind is StepInputs.graph_kind, the cascade choice
step_inputs.shared_prefix_blocks):

* decodes only (graph "decode"): _decode_split_kernel (DECODE_PLAIN), then
  _decode_reduce_kernel if the contexts are split.
* decodes only, sharing a prefix (graph "cascade"): _decode_split_kernel with
  DECODE_SHARED_PREFIX, then _own_keys_kernel (which merges all parts itself when it has
  one split), then _decode_reduce_kernel if it has more.
* prompt chunks only (graph "prefill", up to the largest captured size): _mixed_attention_kernel.
* decodes, then prompt chunks (eager): the decodes as above, then _mixed_attention_kernel
  from the first prompt chunk on.
"""

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.qk_prologue import QKPrologue
from minivllm.kernels import fused_ops
from minivllm.kernels.cascade_attention import (
    paged_attention_decode_shared_prefix,
    shared_prefix_config,
    shared_prefix_num_splits,
)
from minivllm.kernels.common import cdiv, next_power_of_2, sm_count
from minivllm.kernels.decode_attention import (
    DECODE_MAX_SPLITS,
    DECODE_PROGRAMS_PER_SM,
    MOST_DECODE_PROGRAMS_PER_SM,
    MOST_DECODE_WAVES,
    decode_config,
    decode_num_splits,
    decode_num_splits_for,
    paged_attention_decode,
)
from minivllm.kernels.mixed_attention import paged_attention_mixed


class TritonAttentionBackend:
    """Attention through the Triton kernels.

    Split-KV decode writes per-split partial results to an fp32 workspace that this object
    owns and shares across layers (they run one after another on one stream). To keep CUDA
    graph capture free of allocations, give the model's shapes at construction:

        num_q_heads, num_kv_heads, head_dim: per-rank attention shape (after TP sharding).
        max_num_seqs: the largest decode batch (the largest captured graph batch size).
        max_splits: cap on programs per (sequence, KV head) context (default 32).
        device: where the workspace lives.

    The workspace is then sized for the worst case, over every batch size <= max_num_seqs,
    of decode_num_splits() plus the cascade's prefix splits (12 MiB for Qwen3-0.6B at 256
    sequences on an H200). Without these arguments it is allocated on first use and grown
    when needed; growing while a CUDA graph is being captured raises.
    """

    def __init__(
        self,
        num_q_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        max_num_seqs: int | None = None,
        max_splits: int = DECODE_MAX_SPLITS,
        device: torch.device | str | None = None,
        num_sms: int | None = None,
    ):
        self.max_splits = max_splits
        self._num_sms = num_sms
        self._part_out: torch.Tensor | None = None  # [rows * head_dim] fp32
        self._part_lse: torch.Tensor | None = None  # [rows] fp32
        if num_q_heads is not None and num_kv_heads is not None and head_dim is not None and max_num_seqs is not None:
            device = torch.device(device if device is not None else "cuda")
            num_sms = self._sm_count(device)
            # Over all batch sizes the split heuristic can see (max_seq_len unbounded, the
            # most programs per SM and the most waves any decode tiles aim for: splits only
            # grow with either), the largest batch * splits product bounds every decode
            # step's workspace.
            # A cascade step adds the prefix splits, most with the fewest row tiles: tiles of
            # 128 rows, the largest shared_prefix_config() picks.
            gqa = num_q_heads // num_kv_heads
            rows = max(
                b * (decode_num_splits(b, num_kv_heads, 1 << 30, num_sms, MOST_DECODE_PROGRAMS_PER_SM,
                                       max_splits, MOST_DECODE_WAVES)
                     + shared_prefix_num_splits(cdiv(b * gqa, 128), num_kv_heads, 1 << 30, num_sms,
                                                max_splits))
                for b in range(1, max_num_seqs + 1)
            ) * num_q_heads
            self._alloc_workspace(rows, head_dim, device)

    # -- public interface ----------------------------------------------------------------
    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, prologue: QKPrologue, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Overwrites q with its normed, rotated values (the kernel works in place)."""
        fused_ops.qk_norm_rope_store(positions, q, k, v, prologue.rotary.cos_sin, k_cache, v_cache,
                                     meta.slot_mapping, *prologue.norm_args())
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, meta.max_seq_len,
                                meta.num_shared_prefix_blocks, scale)
        # Mixed step. Sequences with one new token at the front of the batch (its decodes:
        # the runner puts them first) go to the decode kernel: in the mixed kernel each would
        # occupy a whole query tile, wasting its matmul work. (A prefill graph's metadata has
        # none: there every sequence takes the mixed kernel.)
        num_seqs = meta.seq_lens.shape[0]
        num_decodes = meta.num_leading_decodes
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if num_decodes > 0:
            self._decode(q[:num_decodes], k_cache, v_cache, meta.seq_lens[:num_decodes],
                         meta.block_tables[:num_decodes], meta.max_seq_len, meta.num_shared_prefix_blocks,
                         scale, out=out[:num_decodes])
        if num_decodes < num_seqs:
            # The first prompt chunk's first token is row num_decodes: one token per decode.
            paged_attention_mixed(
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                scale, out=out, first_seq=num_decodes, first_token=num_decodes,
                max_query_len=meta.max_query_len)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, max_seq_len: int, num_shared_prefix_blocks: torch.Tensor | None,
                scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """Split-KV decode of these sequences; the cascade where num_shared_prefix_blocks is given."""
        if num_shared_prefix_blocks is not None:
            return self._decode_shared_prefix(q, k_cache, v_cache, seq_lens, block_tables, max_seq_len,
                                              num_shared_prefix_blocks, scale, out)
        num_seqs, num_q_heads, head_dim = q.shape
        config = decode_config(head_dim, q.dtype, k_cache.dtype, num_seqs)
        num_splits = decode_num_splits_for(config, num_seqs, k_cache.shape[2], max_seq_len, self._sm_count(q.device),
                                           self.max_splits)
        part_out = part_lse = None
        if num_splits > 1:
            part_out, part_lse = self._workspace(num_seqs * num_q_heads * num_splits, head_dim, q.device)
        return paged_attention_decode(
            q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits,
            out=out, part_out=part_out, part_lse=part_lse, config=config)

    def _decode_shared_prefix(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              seq_lens: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int,
                              num_shared_prefix_blocks: torch.Tensor, scale: float,
                              out: torch.Tensor | None) -> torch.Tensor:
        """Cascade decode: the shared prefix once per tile of queries, then each sequence's
        own keys, merged. The prefix length is on the device: split counts are chosen for
        contexts up to max_seq_len (splits past the real lengths stay empty)."""
        num_seqs, num_q_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        num_sms = self._sm_count(q.device)
        num_rows = num_seqs * (num_q_heads // num_kv_heads)  # (sequence, head) rows per KV head
        prefix_cfg = shared_prefix_config(head_dim, q.dtype, k_cache.dtype, num_rows)
        num_row_tiles = cdiv(num_rows, prefix_cfg.block_m)
        prefix_splits = shared_prefix_num_splits(num_row_tiles, num_kv_heads, max_seq_len, num_sms,
                                                 self.max_splits)
        suffix_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, DECODE_PROGRAMS_PER_SM,
                                          self.max_splits)  # own-keys programs are 4 warps
        part_out, part_lse = self._workspace(
            num_seqs * num_q_heads * (prefix_splits + suffix_splits), head_dim, q.device)
        return paged_attention_decode_shared_prefix(
            q, k_cache, v_cache, seq_lens, block_tables, num_shared_prefix_blocks, scale,
            prefix_splits=prefix_splits, suffix_splits=suffix_splits,
            out=out, part_out=part_out, part_lse=part_lse, prefix_config=prefix_cfg)

    def warm_up_shared_prefix(self, q_shape: tuple[int, int], dtype: torch.dtype, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, max_num_seqs: int) -> None:
        """Compile the cascade kernels at start-up for every row-tile size a batch of up to
        max_num_seqs can use: a compilation inside a step stalls it for about a second.
        q_shape: (num_q_heads, head_dim). Reads block 0 of the cache, writes nothing to it."""
        num_q_heads, head_dim = q_shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        gqa = num_q_heads // num_kv_heads
        device = k_cache.device
        batch_for_tile: dict[int, int] = {}  # BLOCK_M -> a batch size that uses it
        for num_seqs in range(1, max_num_seqs + 1):
            block_m = shared_prefix_config(head_dim, dtype, k_cache.dtype, num_seqs * gqa).block_m
            batch_for_tile.setdefault(block_m, num_seqs)
        for num_seqs in batch_for_tile.values():
            meta = AttentionMetadata(
                query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
                seq_lens=torch.full((num_seqs,), block_size + 1, dtype=torch.int32, device=device),
                block_tables=torch.zeros((num_seqs, 2), dtype=torch.int32, device=device),
                slot_mapping=torch.full((num_seqs,), -1, dtype=torch.int64, device=device),
                max_query_len=1, max_seq_len=block_size + 1, num_leading_decodes=num_seqs)
            meta.num_shared_prefix_blocks = torch.ones(1, dtype=torch.int32, device=device)
            q = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=dtype, device=device)
            self.attend(q, k_cache, v_cache, meta, 1.0)

    # -- helpers -------------------------------------------------------------------------
    def _sm_count(self, device: torch.device) -> int:
        return self._num_sms if self._num_sms is not None else sm_count(device)

    def _alloc_workspace(self, rows: int, head_dim: int, device: torch.device) -> None:
        self._part_out = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self._part_lse = torch.empty(rows, dtype=torch.float32, device=device)

    def _workspace(self, rows: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ok = (
            self._part_out is not None
            and self._part_lse is not None
            and self._part_out.device == device
            and self._part_lse.numel() >= rows
            and self._part_out.numel() >= rows * head_dim
        )
        if not ok:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"split-KV decode workspace too small ({rows} rows x {head_dim} needed) "
                    "during CUDA graph capture: construct TritonAttentionBackend with "
                    "num_q_heads, num_kv_heads, head_dim and max_num_seqs")
            self._alloc_workspace(next_power_of_2(rows), head_dim, device)
        assert self._part_out is not None and self._part_lse is not None  # allocated above, if not before
        return self._part_out, self._part_lse
