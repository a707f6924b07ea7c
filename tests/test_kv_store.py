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
