"""The CPU KV pool: zeros, its own memory after a fork."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from runner.kv_pool.store import KVStore


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


def _resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_prefaulted_pool_is_mapped_in_at_once_and_a_lazy_one_is_not() -> None:
    shape = (4, 256, 16, 4, 64)  # 32 MiB of float32
    before = _resident_bytes()
    lazy = KVStore(*shape, dtype=torch.float32, device="cpu")
    after_lazy = _resident_bytes()
    eager = KVStore(*shape, dtype=torch.float32, device="cpu", prefault=True)
    after_eager = _resident_bytes()
    assert after_lazy - before < lazy.nbytes // 8
    assert after_eager - after_lazy >= eager.nbytes * 9 // 10
    assert not eager.tensor.any()  # zeros, as the lazy pool reads
