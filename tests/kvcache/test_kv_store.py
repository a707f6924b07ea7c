"""The CPU KV pool: zeros, its own memory after a fork."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kvcache.store import KVStore


@pytest.mark.skipif(sys.platform == "win32", reason="needs fork")
def test_a_forked_child_does_not_write_the_parents_pool() -> None:
    kv = KVStore(
        num_layers=1,
        num_blocks=4,
        block_size=4,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
    )
    pid = os.fork()
    if pid == 0:  # the child's writes stay the child's, as with torch.zeros
        kv.tensor.fill_(7.0)
        os._exit(0)
    os.waitpid(pid, 0)
    assert not kv.tensor.any()


def test_copy_slots_copies_leading_slots_of_every_layer() -> None:
    """A tail copy: slots [0, n) of one block into another, keys and values of every layer;
    the rest of both blocks untouched, and a block copied onto itself unchanged (an allocation
    may hand the evicted source back as the destination)."""
    kv = KVStore(3, 5, 4, 2, 8, torch.float32, "cpu")
    kv.tensor.normal_()
    before = kv.tensor.clone()
    kv.copy_slots(1, 1, 3)
    assert torch.equal(kv.tensor, before)
    kv.copy_slots(1, 3, 3)
    assert torch.equal(kv.tensor[:, :, 3, :3], before[:, :, 1, :3])
    assert torch.equal(kv.tensor[:, :, 3, 3:], before[:, :, 3, 3:])
    others = [b for b in range(5) if b != 3]
    assert torch.equal(kv.tensor[:, :, others], before[:, :, others])
