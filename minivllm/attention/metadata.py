"""AttentionMetadata: one step's batch, flattened, as every attention backend sees it."""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Tensors describing a step of B sequences with N new (query) tokens in total.

    Sequence b's new tokens are rows query_start_loc[b]:query_start_loc[b+1] of q, and
    sit at positions seq_lens[b] - query_len_b ... seq_lens[b] - 1 of that sequence: each
    attends causally to every cached token before it and to the new tokens up to itself.
    The KV cache is per layer [num_blocks, block_size, num_kv_heads, head_dim]; token t of
    sequence b lives in block block_tables[b, t // block_size] at offset t % block_size.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32 (cu_seqlens of the new tokens)
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, unused entries 0
    slot_mapping: torch.Tensor  # [N] int64, where each new token's K/V is stored; -1: skip
    max_query_len: int
    max_seq_len: int
    # Rows of one new token at the front of the batch (decodes: the runner puts them first),
    # which backends batch apart from the prompt chunks after them; all rows of a
    # decode-only step.
    num_leading_decodes: int
    # Host copies, for the torch backend's per-sequence loop. None in CUDA graphs, whose
    # replays change the device values without the host knowing.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Steps whose decodes (the sequences with one new token that lead the batch: all of a
    # decode-only step) have block tables that all begin with the same blocks (a prefix they
    # share, as prefix caching leaves it): how many, as a 1-element int32 tensor on the
    # device, so that attention reads the shared prefix once per tile of queries (cascade
    # decode) instead of once per sequence. On the device so that one CUDA graph serves any
    # prefix. None: no shared prefix used.
    num_shared_prefix_blocks: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
