"""BlockTableRows: the step's block tables from persistent rows, against a table built afresh."""

from __future__ import annotations

import random

import numpy as np
import pytest

from runner.engine.step.model_runner import BlockTableRows


def fresh(tables: list[list[int]]) -> np.ndarray:
    """The reference: [batch, longest] int32, padded with 0."""
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
    for row, table in zip(out, tables, strict=True):
        row[: len(table)] = table
    return out


@pytest.mark.parametrize("seed", range(20))
def test_rows_match_tables_built_afresh(seed: int) -> None:
    """Random steps of a live batch: tables grow in place, sequences finish and arrive, some
    are readmitted with a new list (other blocks), batches are random subsets in random
    order, and the starting rows and width are too small (both must grow)."""
    rng = random.Random(seed)
    rows = BlockTableRows(num_rows=2, width=2)
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(60):
        for _ in range(rng.randint(0, 3)):  # arrivals
            live[next_id] = [rng.randrange(1000) for _ in range(rng.randint(1, 4))]
            next_id += 1
        for seq_id in list(live):
            roll = rng.random()
            if roll < 0.1:
                del live[seq_id]  # finished: the runner is never told
            elif roll < 0.2:
                live[seq_id] = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]  # readmitted
            elif roll < 0.6:
                live[seq_id].extend(rng.randrange(1000) for _ in range(rng.randint(1, 3)))
        if not live:
            continue
        batch = rng.sample(sorted(live), rng.randint(1, len(live)))
        got = rows.gather(batch, [live[s] for s in batch])
        np.testing.assert_array_equal(got, fresh([live[s] for s in batch]))


def test_a_readmitted_table_of_the_same_length_is_seen() -> None:
    """Same id, same length, other blocks: the list's identity, not its length, tells."""
    rows = BlockTableRows(num_rows=4, width=4)
    first = [1, 2, 3]
    rows.gather([7], [first])
    again = [4, 5, 6]
    np.testing.assert_array_equal(rows.gather([7], [again]), [[4, 5, 6]])


def test_a_reused_row_is_padded_with_zeros() -> None:
    """A row handed from a long finished table to a short new one shows no stale blocks."""
    rows = BlockTableRows(num_rows=1, width=4)
    rows.gather([1], [[9, 9, 9, 9]])
    got = rows.gather([2, 3], [[5], [6, 7, 8, 1]])  # 1 is gone; both need rows
    np.testing.assert_array_equal(got, [[5, 0, 0, 0], [6, 7, 8, 1]])
