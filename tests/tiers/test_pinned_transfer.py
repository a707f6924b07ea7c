"""Copies between the pool and the tiers' bytes: on CUDA through pinned (page-locked) host
memory, with the same bytes either way; on the CPU, unchanged."""

from __future__ import annotations

import pytest
import torch

from kvcache.store import KVStore
from runner.engine.kv_transfer import read_blocks, to_device, to_host, write_blocks


def round_trip(device: str) -> None:
    kv = KVStore(2, 8, 4, 2, 8, torch.float16, device)
    kv.tensor.copy_(torch.randn(kv.tensor.shape, dtype=torch.float16))
    payloads = read_blocks(kv, [1, 5, 2])
    other = KVStore(2, 8, 4, 2, 8, torch.float16, device)
    write_blocks(other, [3, 0, 7], payloads)
    for src, dst in ((1, 3), (5, 0), (2, 7)):
        assert torch.equal(other.tensor[:, :, dst].cpu(), kv.tensor[:, :, src].cpu())


def test_cpu_copies_are_plain_and_exact() -> None:
    blocks = torch.ones(3, 4)
    assert to_host(blocks) is blocks and not to_host(blocks).is_pinned()
    assert to_device(blocks, torch.device("cpu")) is blocks
    round_trip("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_go_through_pinned_memory() -> None:
    on_device = torch.arange(12.0, device="cuda").view(3, 4)
    host = to_host(on_device)
    assert host.is_pinned() and torch.equal(host, on_device.cpu())
    assert torch.equal(to_device(host, torch.device("cuda")), on_device)
    round_trip("cuda")
