"""A step's inputs: from a ScheduledBatch (decodes first: its docstring) to the rows of
the persistent input buffers, and the metadata the model and kernels take."""

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.executor.cuda_graphs import GraphKind, GraphShape
from minivllm.executor.input_buffers import HostSet, StepFields

# Cascade attention pays off when many decoding sequences share a long prefix; below
# either threshold the plain decode kernel runs. (Estimates, not swept: W3's 256 sequences
# sharing 2,048 tokens are far past both.)
CASCADE_MIN_SEQS = 8
CASCADE_MIN_PREFIX_TOKENS = 256


@dataclass
class StepInputs:
    """A step's inputs as prepared on the host: the rows each buffer field uses (numpy
    views of the current host set) and the host-side metadata. This is what rank 0 ships
    to the other ranks; pickling copies just those rows."""

    arrays: StepFields[np.ndarray]
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    graph: GraphShape | None  # run as the CUDA graph of this (tokens, sequence rows); None: eagerly
    cascade: bool  # every decode of the step starts with the same blocks: cascade attention

    @property
    def graph_kind(self) -> GraphKind:
        return "prefill" if self.max_query_len > 1 else "cascade" if self.cascade else "decode"


@dataclass
class ModelInputs:
    """A step's inputs on the device, as the model takes them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to sample from


def prepare_step_inputs(batch: ScheduledBatch, host: HostSet, block_size: int,
                        last_sampled_rows: dict[int, int], detect_cascade: bool,
                        graph: GraphShape | None = None) -> StepInputs:
    """Write the step into a host buffer set (host work only).

    A sequence's newest token may still be pending (sampled by the step in flight, not yet
    read back): it is written as 0, and pending_dst/pending_src say where the upload copies
    it from that step's output on the device (last_sampled_rows: sequence id -> its row
    there). detect_cascade: look for a prefix shared by every decode of the step (the decode
    rows that lead it: all of a decode-only step).
    graph: for a step run as the CUDA graph of that shape (StepGraphs.padded_shape), the rows
    past the batch are filled with harmless padding: tokens stored nowhere, sequences empty.
    """
    bs = block_size
    buf = host.arrays
    num_seqs = len(batch)
    num_new = np.array(batch.num_new_tokens, dtype=np.int64)
    computed = np.array(batch.num_computed_tokens, dtype=np.int64)
    seq_lens = computed + num_new
    query_start_loc = buf.query_start_loc
    query_start_loc[0] = 0
    np.cumsum(num_new, out=query_start_loc[1:num_seqs + 1])
    num_tokens = int(query_start_loc[num_seqs])
    # Position of every new token: its sequence's computed count plus its offset in the chunk.
    row_of_token = np.repeat(np.arange(num_seqs), num_new)
    positions = computed[row_of_token] + np.arange(num_tokens) - query_start_loc[row_of_token]
    buf.positions[:num_tokens] = positions
    # A sequence's inputs are its tokens computed .. seq_len. The known ones are copied for the
    # rows that have any (prompt chunks); the last input may still be pending (a decode's one
    # input, usually): written as 0, the upload copies it from the step in flight's output.
    seqs = batch.seqs
    known_end = np.minimum(seq_lens, [len(seq.token_ids) for seq in seqs])
    input_ids = buf.input_ids
    for i in np.flatnonzero(known_end > computed).tolist():
        start, end, dst = int(computed[i]), int(known_end[i]), int(query_start_loc[i])
        input_ids[dst:dst + end - start] = seqs[i].token_ids[start:end]
    pending_rows = np.flatnonzero(known_end < seq_lens)
    num_pending = len(pending_rows)
    pending_dst = buf.pending_dst[:num_pending]
    pending_dst[:] = query_start_loc[pending_rows + 1] - 1  # each pending row's last input
    input_ids[pending_dst] = 0
    buf.pending_src[:num_pending] = [last_sampled_rows[seqs[i].seq_id] for i in pending_rows.tolist()]
    tables = [seq.block_table for seq in seqs]
    host.block_tables.write(tables)  # only what changed since this host set last held them
    block_tables = buf.block_tables
    width = max(map(len, tables))
    buf.slot_mapping[:num_tokens] = (
        block_tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs)
    buf.seq_lens[:num_seqs] = seq_lens
    sampled = np.array(batch.samples, dtype=bool)
    logits_indices = query_start_loc[1:num_seqs + 1][sampled] - 1
    buf.logits_indices[:len(logits_indices)] = logits_indices
    shared_blocks = 0
    if detect_cascade:
        num_decodes = batch.num_leading_decodes
        shared_blocks = shared_prefix_blocks(block_tables[:num_decodes], seq_lens[:num_decodes], bs)
        buf.num_shared_prefix_blocks[0] = shared_blocks
    rows, tokens = num_seqs, num_tokens
    if graph is not None:
        tokens, rows = graph
        pad_tokens, pad_rows = slice(num_tokens, tokens), slice(num_seqs, rows)
        buf.input_ids[pad_tokens] = buf.positions[pad_tokens] = 0
        buf.slot_mapping[pad_tokens] = -1
        buf.seq_lens[pad_rows] = 0  # kernels skip empty rows
        host.block_tables.clear(num_seqs, rows)
        # Empty sequences, one token each in a decode graph (the decode kernel's layout).
        query_start_loc[num_seqs + 1:rows + 1] = (np.arange(num_tokens + 1, rows + 1)
                                                  if num_tokens == num_seqs else num_tokens)
    # Rank 0 uploads whole block-table rows; the other ranks get only the columns in use
    # (the rest are zeros), which keeps long-context messages small.
    arrays = StepFields(
        input_ids=buf.input_ids[:tokens], positions=buf.positions[:tokens], slot_mapping=buf.slot_mapping[:tokens],
        query_start_loc=query_start_loc[:rows + 1], seq_lens=buf.seq_lens[:rows],
        block_tables=block_tables[:rows, :width], logits_indices=buf.logits_indices[:len(logits_indices)],
        pending_dst=buf.pending_dst[:num_pending], pending_src=buf.pending_src[:num_pending],
        num_shared_prefix_blocks=buf.num_shared_prefix_blocks[:1 if shared_blocks else 0])
    return StepInputs(
        arrays=arrays,
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc[:num_seqs + 1].tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        graph=graph,
        cascade=shared_blocks > 0,
    )


def shared_prefix_blocks(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """How many leading block-table entries every sequence shares, if enough to use cascade
    attention (else 0). Each sequence keeps at least one token of its own past the prefix."""
    if len(block_tables) < CASCADE_MIN_SEQS:
        return 0
    limit = int((seq_lens.min() - 1) // block_size)
    equal = block_tables[:, :limit] == block_tables[0, :limit]
    # (All equal is the common case, and a flat all() is cheaper than one along the rows.)
    shared = limit if equal.all() else int(equal.all(axis=0).argmin())
    return shared if shared * block_size >= CASCADE_MIN_PREFIX_TOKENS else 0
