"""The runner's host-side step inputs: block-table rows written incrementally."""

import random

import numpy as np

from minivllm.executor.input_buffers import BlockTableRows


def full_rows(tables: list[list[int]], shape: tuple[int, int]) -> np.ndarray:
    """What the rows must hold: each table, zero-padded; rows past the tables zero."""
    expected = np.zeros(shape, dtype=np.int32)
    for i, table in enumerate(tables):
        expected[i, :len(table)] = table
    return expected


def test_block_table_rows_match_a_full_copy_under_random_changes() -> None:
    """Sequences grow their tables, finish, are preempted (a new, shorter list), swap rows
    and are padded away: after every step the rows equal a fresh zero-padded copy."""
    rng = random.Random(0)
    shape = (8, 12)
    rows = BlockTableRows(np.zeros(shape, dtype=np.int32))
    pool = [[rng.randrange(1, 1000) for _ in range(rng.randrange(1, 6))] for _ in range(12)]
    for _ in range(400):
        seq = rng.randrange(len(pool))
        change = rng.random()
        if change < 0.5 and len(pool[seq]) < shape[1]:
            pool[seq].append(rng.randrange(1, 1000))  # a new block, same list
        elif change < 0.7:
            pool[seq] = [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 4))]  # preempted
        batch = rng.sample(range(len(pool)), rng.randrange(1, shape[0] + 1))
        tables = [pool[i] for i in batch]
        rows.write(tables)
        padded = rng.randrange(len(tables), shape[0] + 1)
        rows.clear(len(tables), padded)
        expected = full_rows(tables, shape)
        np.testing.assert_array_equal(rows.rows[:padded], expected[:padded])
