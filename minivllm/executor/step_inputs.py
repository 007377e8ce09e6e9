"""A step's inputs: from its rows in the runner's order (persistent_batch.StepRows, decodes
first) to the rows of the persistent input buffers, and the metadata the model and kernels
take."""

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.executor.cuda_graphs import GraphKind, GraphShape
from minivllm.executor.input_buffers import HostSet, StepFields
from minivllm.executor.persistent_batch import PromptLogprobRows, StepRows

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
    num_decodes: int  # the leading rows of one new token (StepRows)
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    graph: GraphShape | None  # run as the CUDA graph of this (tokens, sequence rows); None: eagerly
    cascade: bool  # every decode of the step starts with the same blocks: cascade attention
    # Prompt positions whose logprobs the step computes (every rank computes their logits).
    prompt_logprobs: PromptLogprobRows | None = None

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


def prepare_step_inputs(rows: StepRows, host: HostSet, block_size: int,
                        last_sampled_rows: dict[int, int], detect_cascade: bool,
                        graph: GraphShape | None = None, prompt_logprobs: PromptLogprobRows | None = None
                        ) -> StepInputs:
    """Write the step into a host buffer set (host work only).

    A sequence's newest token may still be pending (sampled by the step in flight, not yet
    read back): it is written as 0, and pending_dst/pending_src say where the upload copies
    it from that step's output on the device (last_sampled_rows: sequence id -> its row
    there). detect_cascade: look for a prefix shared by every decode of the step (the
    one-token rows that lead it: all of a decode-only step).
    graph: for a step run as the CUDA graph of that shape (StepGraphs.padded_shape), the rows
    past the batch are filled with harmless padding: tokens stored nowhere, sequences empty.
    prompt_logprobs: the step's prompt positions whose logprobs are due
    (PersistentBatch.prompt_logprob_rows), carried along.
    """
    bs = block_size
    buf = host.arrays
    states = rows.states
    num_seqs = len(states)
    num_new, computed = rows.num_new_tokens, rows.num_computed_tokens
    seq_lens = computed + num_new
    query_start_loc = buf.query_start_loc
    query_start_loc[:num_seqs + 1] = rows.query_start_loc
    num_tokens = rows.num_tokens
    # Position of every new token: its sequence's computed count plus its offset in the chunk.
    token_rows = rows.token_rows
    positions = computed[token_rows] + rows.token_offsets
    buf.positions[:num_tokens] = positions
    # A sequence's inputs are its tokens computed .. seq_len, its draft tokens last (if any).
    # The known ones are copied for the rows that have any (prompt chunks); the last input
    # before the drafts may still be pending (a decode's one input, usually): written as 0, the
    # upload copies it from the step in flight's output.
    drafts = rows.out.draft_token_ids
    num_drafts = rows.num_drafts
    inputs_end = seq_lens - num_drafts
    known_end = np.minimum(inputs_end, [len(state.token_ids) for state in states])
    input_ids = buf.input_ids
    for i in np.flatnonzero(known_end > computed).tolist():
        start, end, dst = int(computed[i]), int(known_end[i]), int(query_start_loc[i])
        input_ids[dst:dst + end - start] = states[i].token_ids[start:end]
    if drafts:
        for i in np.flatnonzero(num_drafts).tolist():
            end = int(query_start_loc[i + 1])
            input_ids[end - int(num_drafts[i]):end] = drafts[states[i].seq_id]
    pending_rows = np.flatnonzero(known_end < inputs_end)
    num_pending = len(pending_rows)
    if num_pending:
        pending_dst = buf.pending_dst[:num_pending]
        pending_dst[:] = query_start_loc[pending_rows + 1] - 1 - num_drafts[pending_rows]  # each one's last input
        input_ids[pending_dst] = 0
        buf.pending_src[:num_pending] = [last_sampled_rows[states[i].seq_id] for i in pending_rows.tolist()]
    width = host.block_tables.write(states)  # only what changed since this host set last held them
    block_tables = buf.block_tables
    buf.slot_mapping[:num_tokens] = (
        block_tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs)
    buf.seq_lens[:num_seqs] = seq_lens
    # The sampled rows' last tokens, in the scheduler's order (the order of the results); a
    # row with drafts also its last known token and each draft but the last (the positions
    # that verify the drafts), then the last one (its next token's, the "bonus").
    logits_indices = rows.logits_indices
    buf.logits_indices[:len(logits_indices)] = logits_indices
    num_decodes = rows.num_decodes
    shared_blocks = 0
    if detect_cascade:
        shared_blocks = shared_prefix_blocks(block_tables[:num_decodes], seq_lens[:num_decodes], bs)
        buf.num_shared_prefix_blocks[0] = shared_blocks
    used_rows, used_tokens = num_seqs, num_tokens
    if graph is not None:
        used_tokens, used_rows = graph
        pad_tokens, pad_rows = slice(num_tokens, used_tokens), slice(num_seqs, used_rows)
        buf.input_ids[pad_tokens] = buf.positions[pad_tokens] = 0
        buf.slot_mapping[pad_tokens] = -1
        buf.seq_lens[pad_rows] = 0  # kernels skip empty rows
        host.block_tables.clear(num_seqs, used_rows)
        # Empty sequences, one token each in a decode graph (the decode kernel's layout).
        query_start_loc[num_seqs + 1:used_rows + 1] = (np.arange(num_tokens + 1, used_rows + 1)
                                                       if num_tokens == num_seqs else num_tokens)
    # Rank 0 uploads whole block-table rows; the other ranks get only the columns in use
    # (the rest are zeros), which keeps long-context messages small.
    return StepInputs(
        arrays=host.used_rows(used_tokens, used_rows, width, len(logits_indices), num_pending,
                              1 if shared_blocks else 0),
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
        num_decodes=num_decodes,
        query_start_loc_cpu=query_start_loc[:num_seqs + 1].tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        graph=graph,
        cascade=shared_blocks > 0,
        prompt_logprobs=prompt_logprobs,
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
