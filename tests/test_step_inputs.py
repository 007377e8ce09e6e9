"""The runner's side of the seam, host only: what it keeps of each sequence (PersistentBatch),
the order it runs a step's rows in (StepRows.order) and block-table rows written incrementally."""

import random

import numpy as np

from minivllm import SamplingParams
from minivllm.engine.scheduler_output import NewSequenceData, SchedulerOutput
from minivllm.executor.input_buffers import BlockTableRows
from minivllm.executor.persistent_batch import PersistentBatch, SequenceState, StepRows


def make_state(seq_id: int, block_table: list[int]) -> SequenceState:
    return SequenceState(seq_id, [1, 2, 3], 3, SamplingParams(), False, None, block_table)


def full_rows(tables: list[list[int]], shape: tuple[int, int]) -> np.ndarray:
    """What the rows must hold: each table, zero-padded; rows past the tables zero."""
    expected = np.zeros(shape, dtype=np.int32)
    for i, table in enumerate(tables):
        expected[i, :len(table)] = table
    return expected


def test_block_table_rows_match_a_full_copy_under_random_changes() -> None:
    """Sequences grow their tables, have entries replaced (a preempted sequence admitted
    again), finish (a new sequence takes their place), swap rows and are padded away: after
    every step the rows equal a fresh zero-padded copy."""
    rng = random.Random(0)
    shape = (8, 12)
    rows = BlockTableRows(np.zeros(shape, dtype=np.int32))
    next_id = 12
    pool = [make_state(i, [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 6))]) for i in range(next_id)]
    for _ in range(400):
        k = rng.randrange(len(pool))
        state, change = pool[k], rng.random()
        if change < 0.5 and len(state.block_table) < shape[1]:
            state.update_block_table(len(state.block_table), [rng.randrange(1, 1000)])  # a new block
        elif change < 0.7:
            start = rng.randrange(0, len(state.block_table) + 1)
            count = rng.randrange(0, min(4, shape[1] - start + 1))
            state.update_block_table(start, [rng.randrange(1, 1000) for _ in range(count)])
        elif change < 0.8:
            pool[k] = make_state(next_id, [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 6))])
            next_id += 1
        batch = rng.sample(pool, rng.randrange(1, shape[0] + 1))
        width = rows.write(batch)
        tables = [state.block_table for state in batch]
        assert width == max(map(len, tables))
        padded = rng.randrange(len(tables), shape[0] + 1)
        rows.clear(len(tables), padded)
        np.testing.assert_array_equal(rows.rows[:padded], full_rows(tables, shape)[:padded])


def scheduler_output(rows: list[tuple[int, int, int]], samples: list[bool] | None = None) -> SchedulerOutput:
    """A step of (seq_id, computed tokens, new tokens) rows; a row samples when it has one new token."""
    return SchedulerOutput([seq_id for seq_id, _, _ in rows], [new for _, _, new in rows],
                           [computed for _, computed, _ in rows],
                           samples if samples is not None else [new == 1 for _, _, new in rows])


def test_rows_run_decodes_first_longest_context_first() -> None:
    """Every one-token row goes first (one after a prompt chunk too), the longest context
    first, ties in the scheduler's order; the other rows keep the scheduler's order; the
    sampled rows are listed in the scheduler's order."""
    rows = [(10, 5, 1), (11, 40, 1), (12, 12, 1), (13, 40, 1), (14, 0, 30), (15, 9, 1), (16, 3, 7)]
    out = scheduler_output(rows, samples=[True, True, True, True, False, True, True])
    states = [make_state(seq_id, [seq_id]) for seq_id, _, _ in rows]
    ordered = StepRows.order(states, out)
    assert [state.seq_id for state in ordered.states] == [11, 13, 12, 15, 10, 14, 16]
    assert ordered.num_computed_tokens.tolist() == [40, 40, 12, 9, 5, 0, 3]
    assert ordered.num_new_tokens.tolist() == [1, 1, 1, 1, 1, 30, 7]
    assert ordered.num_decodes == 5 and ordered.num_tokens == 42
    assert ordered.sampled_ids == [10, 11, 12, 13, 15, 16]
    assert [ordered.states[row].seq_id for row in ordered.sample_rows] == ordered.sampled_ids
    assert [state.seq_id for state in ordered.sampled] == ordered.sampled_ids
    assert ordered.sampled_row_of == {seq_id: row for row, seq_id in enumerate(ordered.sampled_ids)}


def test_persistent_batch_follows_the_scheduler_output() -> None:
    """New sequences get their own copies of the prompt and the block table, and their seed;
    block updates append or replace entries; finished sequences are dropped."""
    batch = PersistentBatch()
    prompt, table = [5, 6, 7], [3, 4]
    seeded = SamplingParams(temperature=1.0, seed=9)
    batch.update(SchedulerOutput(new_seqs=[NewSequenceData(0, prompt, seeded, 9, table),
                                           NewSequenceData(1, [8], SamplingParams(), None, [2])]))
    first, second = batch.states[0], batch.states[1]
    # The runner grows lists of its own, never the scheduler's.
    assert first.token_ids == prompt and first.token_ids is not prompt
    assert first.block_table == table and first.block_table is not table
    assert first.seed == 9 and second.seed is None
    batch.update(SchedulerOutput(block_updates=[(0, 2, [13]), (1, 0, [14, 15])]))
    assert first.block_table == [3, 4, 13] and first.block_table_epoch == 0  # appended
    assert second.block_table == [14, 15] and second.block_table_epoch == 1  # replaced
    batch.update(SchedulerOutput(finished_seq_ids=[0]))
    assert list(batch.states) == [1]


def test_a_steady_batch_keeps_the_last_steps_order() -> None:
    """The same rows again (a steady decode batch) reuse the last step's order, which is
    the order they would get afresh; other rows are ordered afresh."""
    batch = PersistentBatch()
    batch.update(SchedulerOutput(new_seqs=[NewSequenceData(i, [1] * 20, SamplingParams(), None, [i])
                                           for i in range(4)]))
    last = batch.rows(scheduler_output([(0, 5, 1), (1, 9, 1), (2, 0, 4), (3, 9, 1)]))
    for steady, reused in (([(0, 6, 1), (1, 10, 1), (2, 4, 4), (3, 10, 1)], True), ([(0, 7, 1), (3, 11, 1)], False)):
        out = scheduler_output(steady)
        rows = batch.rows(out)
        assert (rows.source_rows is last.source_rows) == reused
        fresh = StepRows.order([batch.states[seq_id] for seq_id in out.seq_ids], out)
        assert rows.out is out and rows.states == fresh.states and rows.num_decodes == fresh.num_decodes
        for name in ("source_rows", "num_new_tokens", "num_computed_tokens", "sample_rows"):
            np.testing.assert_array_equal(getattr(rows, name), getattr(fresh, name))
        assert (rows.sampled_ids, rows.sampled, rows.sampled_row_of) == (fresh.sampled_ids, fresh.sampled,
                                                                          fresh.sampled_row_of)
        last = rows
    assert [state.seq_id for state in last.states] == [3, 0]
