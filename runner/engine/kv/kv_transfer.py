"""Copying whole blocks' K/V between the pool (kvcache/store.py) and bytes, for the tiers below
the device pool and the prefix-cache file (kvcache/tiers/block_value.py). One block's bytes
are its slice ``[layers, 2, block_size, kv_heads, head_dim]`` of the pool, C-contiguous, in the
pool's dtype: what ``BlockSpec.block_nbytes`` counts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvcache.store import KVStore
from kvcache.tiers import BlockSpec

# Blocks copied per transfer: on a GPU whose memory the pool fills, a copy of every block at
# once might not fit.
_BLOCKS_PER_COPY = 256


def block_spec(kv: KVStore, identity: str, shard_nbytes: list[int] | None = None) -> BlockSpec:
    """What a stored block must agree with to be loaded into ``kv``; `shard_nbytes`: with
    tensor parallelism, one block's bytes on each rank (a stored block holds them all)."""
    nbytes = KVStore.bytes_per_block(
        kv.num_layers, kv.block_size, kv.num_kv_heads, kv.head_dim, kv.dtype
    )
    if shard_nbytes is not None:
        nbytes = sum(shard_nbytes)
    return BlockSpec(
        identity, kv.dtype_name, kv.block_size, kv.num_layers, kv.num_kv_heads, kv.head_dim,
        nbytes,
    )  # fmt: skip


def to_host(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` in host memory: page-locked (pinned) when they are on CUDA, so the copy is
    one DMA instead of a copy through the driver's own staging buffer; on the CPU, as they
    are (no copy, no change)."""
    if blocks.device.type != "cuda":
        return blocks.cpu()
    host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
    host.copy_(blocks)
    return host


def to_device(blocks: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ``blocks`` on ``device``: through pinned memory when it is CUDA (torch's pinned
    allocator keeps the buffer until the asynchronous copy is done)."""
    if device.type != "cuda":
        return blocks.to(device)
    return blocks.pin_memory().to(device, non_blocking=True)


def read_blocks(kv: KVStore, block_ids: Sequence[int]) -> list[bytes]:
    """Each block's K/V as bytes (copied off the pool, so the block may be reused at once)."""
    if kv.device.type == "cpu":
        # One strided copy a block, single-threaded: torch's gather and transpose of a few
        # blocks over the intra-op pool cost ~10x that (and wait on the cores the step uses).
        pool = _host_bytes(kv)
        return [pool[:, :, block].tobytes() for block in block_ids]
    out: list[bytes] = []
    for start in range(0, len(block_ids), _BLOCKS_PER_COPY):
        ids = torch.tensor(block_ids[start : start + _BLOCKS_PER_COPY], device=kv.device)
        # [layers, 2, n, B, H, D] -> [n, layers, 2, B, H, D]: one block's bytes contiguous
        blocks = to_host(kv.tensor.index_select(2, ids).movedim(2, 0).contiguous())
        raw = blocks.view(torch.uint8).reshape(len(ids), -1).numpy()
        out.extend(row.tobytes() for row in raw)
    return out


def write_blocks(
    kv: KVStore, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
) -> None:
    """Put each payload (one block's bytes, as ``read_blocks`` gives them) into its block."""
    if kv.device.type == "cpu":
        # One copy a block, from the payload's bytes straight into the pool (numpy reads a
        # read-only buffer without a copy): joining the payloads into one fresh buffer first
        # cost ten times as much under the engine lock, the fresh memory's page faults.
        pool = _host_bytes(kv)
        shape = pool.shape[:2] + pool.shape[3:]
        for block, payload in zip(block_ids, payloads, strict=True):
            pool[:, :, block] = np.frombuffer(payload, dtype=np.uint8).reshape(shape)
        return
    shape = (kv.num_layers, 2, kv.block_size, kv.num_kv_heads, kv.head_dim)
    for start in range(0, len(block_ids), _BLOCKS_PER_COPY):
        chunk = payloads[start : start + _BLOCKS_PER_COPY]
        raw = bytearray().join(chunk)  # writable: torch.frombuffer warns on read-only
        blocks = torch.frombuffer(raw, dtype=torch.uint8).view(kv.dtype).view(len(chunk), *shape)
        ids = torch.tensor(block_ids[start : start + len(chunk)], device=kv.device)
        kv.tensor.index_copy_(2, ids, to_device(blocks, kv.device).movedim(0, 2))


def _host_bytes(kv: KVStore) -> np.ndarray:
    """The CPU pool's memory as bytes, [layers, 2, blocks, B, H, D * itemsize] (a view: no
    copy; numpy has no bfloat16, bytes have every dtype)."""
    return kv.tensor.view(torch.uint8).numpy()
