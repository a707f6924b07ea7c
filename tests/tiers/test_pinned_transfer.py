"""Copies between the pool and the tiers' bytes: on CUDA through pinned (page-locked) host
memory, with the same bytes either way; on the CPU, unchanged."""

from __future__ import annotations

import pytest
import torch

from runner.engine.kv.transfer import read_blocks, to_device, to_host, write_blocks
from runner.kv_pool.store import KVStore


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_writes_fill_their_blocks_only(dtype: torch.dtype) -> None:
    """Each payload (bytes, or a memoryview of them) is copied straight into its block: the
    other blocks keep what they held."""
    kv = KVStore(2, 8, 4, 2, 8, dtype, "cpu")
    kv.tensor.copy_(torch.randn(kv.tensor.shape).to(dtype))
    payloads = read_blocks(kv, [1, 5])
    other = KVStore(2, 8, 4, 2, 8, dtype, "cpu")
    other.tensor.fill_(7)
    write_blocks(other, [6, 2], [payloads[0], memoryview(payloads[1])])
    assert torch.equal(other.tensor[:, :, 6], kv.tensor[:, :, 1])
    assert torch.equal(other.tensor[:, :, 2], kv.tensor[:, :, 5])
    untouched = [b for b in range(8) if b not in (6, 2)]
    assert bool((other.tensor[:, :, untouched] == 7).all())
