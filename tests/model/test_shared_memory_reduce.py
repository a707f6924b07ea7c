"""The shared-memory all-reduce of one machine's tensor-parallel ranks
(runner/model/shared_memory_reduce.py): sums and gathers between processes, in rank order, over
many turns (its two slots a rank reused), and a rank that never arrives named in an error."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from runner.model.shared_memory_reduce import SharedMemoryReduce


def rows(rank: int, turn: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * turn + rank)
    return torch.randn(7, 33, generator=generator)


def rank_one(name: str, turns: int) -> None:
    local = SharedMemoryReduce(name, 1, 2)
    for turn in range(turns):
        local.all_reduce(rows(1, turn))
        local.gather(rows(1, turn) * 2)
    local.close()


def test_sums_and_gathers_between_two_processes() -> None:
    name = f"kvcache-test-{os.getpid()}"
    local = SharedMemoryReduce(name, 0, 2, create=True)
    other = mp.get_context("spawn").Process(target=rank_one, args=(name, 50))
    other.start()
    try:
        for turn in range(50):
            total = local.all_reduce(rows(0, turn))
            assert torch.equal(total, rows(0, turn) + rows(1, turn))  # rank order: 0, then 1
            parts = local.gather(rows(0, turn) * 2)
            assert parts is not None
            assert torch.equal(parts[1], rows(1, turn) * 2) and torch.equal(
                parts[0], rows(0, turn) * 2
            )
    finally:
        other.join(timeout=30)
        local.close()
    assert other.exitcode == 0


def test_a_rank_that_never_arrives_is_named() -> None:
    local = SharedMemoryReduce(f"kvcache-test-late-{os.getpid()}", 0, 2, timeout_s=0.2, create=True)
    try:
        with pytest.raises(RuntimeError, match=r"ranks \[1\] did not reach step 1"):
            local.all_reduce(torch.ones(3))
    finally:
        local.close()


def test_rows_larger_than_a_slot_do_not_fit() -> None:
    local = SharedMemoryReduce(f"kvcache-test-fit-{os.getpid()}", 0, 1, create=True)
    try:
        assert local.fits(torch.ones(16))
        assert not local.fits(torch.ones(9 << 20, dtype=torch.uint8))
        assert torch.equal(local.all_reduce(torch.arange(5.0)), torch.arange(5.0))  # one rank
    finally:
        local.close()
