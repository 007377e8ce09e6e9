"""The runner's side of the scheduler seam (engine/scheduler_output.py): what it keeps of
each sequence between steps, and each step's rows in the order it runs them.

Only rank 0 keeps these: it prepares every step's inputs and samples; the other ranks of a
tensor-parallel engine get the prepared inputs (executor/worker.py).
"""

from dataclasses import dataclass, replace
from itertools import compress
from typing import cast

import numpy as np

from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.layers.sampler import SamplingRow
from minivllm.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class SequenceState:
    """One sequence as the runner knows it, from its first step until it finishes
    (preemptions included)."""

    seq_id: int
    # The prompt, then each token sampled for the sequence as it is collected: the inputs of
    # later steps (prompt chunks, recomputation after a preemption, decodes whose token is
    # no longer pending) and the history that penalties read.
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    needs_token_history: bool  # params.needs_token_history, read once
    seed: int | None  # seeded sequences' (their draws hash it with each output position)
    block_table: list[int]
    # Top candidates per prompt position whose logprobs it computes (None: none), and the
    # positions done so far: a prefill recomputed after a preemption does not repeat them.
    num_prompt_logprobs: int | None = None
    num_prompt_logprobs_done: int = 0
    # Counts changes to block_table other than appends: a host row written at an older epoch
    # is rewritten whole, one at this epoch gets only the entries appended since
    # (input_buffers.BlockTableRows).
    block_table_epoch: int = 0

    def update_block_table(self, start: int, block_ids: list[int]) -> None:
        """Entries from `start` on := block_ids (SchedulerOutput.block_updates)."""
        table = self.block_table
        if start < len(table):
            del table[start:]
            self.block_table_epoch += 1
        table += block_ids

    def sampling_row(self) -> SamplingRow:
        """The sampler's row; the token history is copied only where sampling reads it."""
        if not self.needs_token_history:
            return SamplingRow(self.params, (), (), self.seed)
        split = self.num_prompt_tokens
        return SamplingRow(self.params, self.token_ids[:split], self.token_ids[split:], self.seed)

    def draft_sampling_rows(self, drafts: list[int]) -> list[SamplingRow]:
        """The sampler's rows at the positions that verify draft tokens and the one after
        them: each as that token's own decode step would sample it, the drafts before it
        taken as outputs (what the sampler reads of them matters only where they are accepted)."""
        row = self.sampling_row()
        if not self.needs_token_history:
            return [row] * (len(drafts) + 1)
        outputs = list(row.output_token_ids)
        return [row, *(replace(row, output_token_ids=outputs + drafts[:j]) for j in range(1, len(drafts) + 1))]


@dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """The prompt positions of a step whose logprobs it computes: at each, the logprob of the
    prompt token that follows, its rank and the top candidates, from the hidden state of the
    position's token. Grouped by sequence, consecutive positions each."""

    seq_ids: list[int]
    num_positions: list[int]  # per sequence
    num_logprobs: list[int]  # per sequence: top candidates asked for
    hidden_rows: np.ndarray  # int64 [positions]: each position's row of the step's hidden states
    target_ids: np.ndarray  # int64 [positions]: the prompt token each position predicts


@dataclass(slots=True)
class StepRows:
    """A step's rows in the order the runner runs them (StepRows.order): the rows of one new
    token (decodes) first, longest context first; then the others in the scheduler's order.

    Decodes first: the Triton attention backend sends the leading one-token rows of a mixed
    step to the split-KV decode kernel and the rest to the mixed kernel (there a decode would
    occupy a whole query tile), the torch backend batches them into one call, and
    StepGraphs.padded_shape runs a step that mixes them with prompt chunks eagerly. Longest
    first: the decode kernel starts its programs in row order, so no long context starts
    last and sets the launch's tail.
    """

    out: SchedulerOutput  # the step
    source_rows: np.ndarray  # row i is the scheduler's row source_rows[i]
    states: list[SequenceState]
    num_new_tokens: np.ndarray  # int64, per row
    num_computed_tokens: np.ndarray  # int64, per row: where its new tokens start
    num_decodes: int  # the leading rows of one new token
    # The rows whose next token the step samples, in the scheduler's order (the order of the
    # sampled logits and of the step's results); their sequence ids and states, likewise; and
    # each one's place in that order (its row of the step's sampled tokens), by id.
    sample_rows: np.ndarray
    sampled_ids: list[int]
    sampled: list[SequenceState]
    sampled_row_of: dict[int, int]
    # Where the rows' tokens sit in the step (int64): each row's first token and the end
    # (cu_seqlens), and each token's row and its place in the row.
    query_start_loc: np.ndarray
    token_rows: np.ndarray
    token_offsets: np.ndarray
    # Speculative decoding: how many of each row's new tokens are draft tokens, its last (int64,
    # 0 for most). The rows that have any sample at each of their positions from their last known
    # token on: the step's sampled logits are the sampled rows' positions, in the scheduler's
    # order (logits_indices: their tokens in the step), each row's first at first_position.
    num_drafts: np.ndarray
    logits_indices: np.ndarray
    first_position: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.token_rows)

    @classmethod
    def order(cls, states: list[SequenceState], out: SchedulerOutput) -> "StepRows":
        """The rows of `out` (states: its rows' states, in its order), decodes first."""
        num_new = np.array(out.num_new_tokens, dtype=np.int64)
        computed = np.array(out.num_computed_tokens, dtype=np.int64)
        one_token = num_new == 1
        decodes = np.flatnonzero(one_token)
        decodes = decodes[np.argsort(-computed[decodes], kind="stable")]  # ties keep their order
        order = np.concatenate((decodes, np.flatnonzero(~one_token)))
        num_rows = len(order)
        row_of = np.empty_like(order)
        row_of[order] = np.arange(num_rows)
        samples = out.samples
        sampled_ids = list(compress(out.seq_ids, samples))
        ordered_states = [states[i] for i in order.tolist()]
        num_new = num_new[order]
        sample_rows = row_of[np.array(samples, dtype=bool)]
        query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        token_rows = np.repeat(np.arange(num_rows), num_new)
        if out.draft_token_ids:
            num_drafts = np.array([len(out.draft_token_ids.get(state.seq_id, ())) for state in ordered_states],
                                  dtype=np.int64)
            per_row = num_drafts[sample_rows] + 1  # positions sampled per sampled row
            first_position = np.cumsum(per_row) - per_row
            logits_indices = (np.repeat(query_start_loc[sample_rows + 1] - per_row - first_position, per_row)
                              + np.arange(int(per_row.sum())))
        else:
            num_drafts = np.zeros(num_rows, dtype=np.int64)
            first_position = np.arange(len(sample_rows))
            logits_indices = query_start_loc[sample_rows + 1] - 1
        return cls(out=out, source_rows=order, states=ordered_states, num_new_tokens=num_new,
                   num_computed_tokens=computed[order], num_decodes=len(decodes), sample_rows=sample_rows,
                   sampled_ids=sampled_ids, sampled=list(compress(states, samples)),
                   sampled_row_of=dict(zip(sampled_ids, range(len(sampled_ids)))),
                   query_start_loc=query_start_loc, token_rows=token_rows,
                   token_offsets=np.arange(len(token_rows)) - query_start_loc[token_rows], num_drafts=num_drafts,
                   logits_indices=logits_indices, first_position=first_position)

    def same_rows(self, out: SchedulerOutput) -> bool:
        """Whether `out` has this step's rows, in the same order, as many new tokens each (as
        many of them drafts) and sampling the same ones: a steady batch, whose order holds
        (each context grew by its row's new tokens, one for each decode, so the decodes keep
        their order by length)."""
        last = self.out
        return (out.seq_ids == last.seq_ids and out.num_new_tokens == last.num_new_tokens
                and out.samples == last.samples and _draft_counts(out) == _draft_counts(last))

    def drafts(self) -> list[list[int]]:
        """Each sampled row's draft tokens, in the scheduler's order; [] for a step without any."""
        step_drafts = self.out.draft_token_ids
        return [step_drafts.get(seq_id, []) for seq_id in self.sampled_ids] if step_drafts else []

    def next_step(self, out: SchedulerOutput) -> "StepRows":
        """The rows of `out`, a step of the same rows (same_rows): only their computed counts
        change."""
        computed = np.array(out.num_computed_tokens, dtype=np.int64)
        return replace(self, out=out, num_computed_tokens=computed[self.source_rows])


def _draft_counts(out: SchedulerOutput) -> tuple[list[int], list[int]]:
    """The rows that have draft tokens (ids, in the scheduler's order) and how many each."""
    drafts = out.draft_token_ids
    return list(drafts), list(map(len, drafts.values()))


class PersistentBatch:
    """The sequences the runner holds, by id, kept up to date from each SchedulerOutput."""

    def __init__(self) -> None:
        self.states: dict[int, SequenceState] = {}
        # Sequences with prompt logprobs still to compute, by id.
        self.awaiting_prompt_logprobs: dict[int, SequenceState] = {}
        self._last_rows: StepRows | None = None

    def update(self, out: SchedulerOutput) -> None:
        """Forget the finished sequences, take in the new ones, apply block-table updates."""
        states = self.states
        for seq_id in out.finished_seq_ids:
            del states[seq_id]
            self.awaiting_prompt_logprobs.pop(seq_id, None)
        for new in out.new_seqs:
            # Copies: the runner grows both lists.
            state = states[new.seq_id] = SequenceState(
                new.seq_id, list(new.prompt_token_ids), len(new.prompt_token_ids), new.params,
                new.params.needs_token_history, new.seed, list(new.block_ids), new.num_prompt_logprobs)
            if new.num_prompt_logprobs is not None and state.num_prompt_tokens > 1:
                self.awaiting_prompt_logprobs[new.seq_id] = state
        for seq_id, start, block_ids in out.block_updates:
            states[seq_id].update_block_table(start, block_ids)

    def rows(self, out: SchedulerOutput) -> StepRows:
        """The step's rows, in the runner's order (after update). A steady batch (the last
        step's rows again: decodes, most steps) keeps the last step's order, and the work of
        finding it: a few list comparisons instead of a pass over the rows."""
        last = self._last_rows
        if last is not None and last.same_rows(out):
            rows = last.next_step(out)
        else:
            rows = StepRows.order(list(map(self.states.__getitem__, out.seq_ids)), out)
        self._last_rows = rows
        return rows

    def prompt_logprob_rows(self, rows: StepRows) -> PromptLogprobRows | None:
        """The step's prompt positions whose logprobs are due (marked done here): those of
        its rows' new tokens that no earlier step covered, the last prompt token excluded (its
        logits pick the first output token). None when there are none; without sequences
        awaiting prompt logprobs (the common case) that takes one check."""
        awaiting = self.awaiting_prompt_logprobs
        if not awaiting:
            return None
        token_starts = np.cumsum(rows.num_new_tokens) - rows.num_new_tokens
        seq_ids, num_positions, num_logprobs, hidden_rows, target_ids = [], [], [], [], []
        for i, state in enumerate(rows.states):
            if state.seq_id not in awaiting:
                continue
            computed = int(rows.num_computed_tokens[i])
            start = state.num_prompt_logprobs_done
            # Such a sequence takes no prefix-cache hits: its chunks start where it stopped, or
            # before (recomputing after a preemption).
            assert computed <= start, (computed, start)
            end = min(computed + int(rows.num_new_tokens[i]), state.num_prompt_tokens - 1)
            if end <= start:
                continue
            first_row = int(token_starts[i]) + start - computed
            seq_ids.append(state.seq_id)
            num_positions.append(end - start)
            num_logprobs.append(cast(int, state.num_prompt_logprobs))  # awaiting: not None
            hidden_rows.append(np.arange(first_row, first_row + end - start))
            target_ids += state.token_ids[start + 1:end + 1]
            state.num_prompt_logprobs_done = end
            if end == state.num_prompt_tokens - 1:
                del awaiting[state.seq_id]
        if not seq_ids:
            return None
        return PromptLogprobRows(seq_ids, num_positions, num_logprobs, np.concatenate(hidden_rows),
                                 np.array(target_ids, dtype=np.int64))
