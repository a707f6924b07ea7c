"""Copying whole blocks' K/V between the pool (runner/kv_pool/store.py) and bytes, for the tiers
below the device pool and the prefix-cache file (kvcache/tiers/block_value.py). One block's bytes
are its slice ``[layers, 2, block_size, kv_heads, head_dim]`` of the pool, C-contiguous, in the
pool's dtype: what ``BlockSpec.block_nbytes`` counts.

The tiers' copies at commit and eviction (``PoolCopies``) never wait for the device on a GPU:
each is queued on the current stream into pinned memory with an event recorded behind it,
and its bytes are waited for by whoever needs them (the tiers' writer thread), not by the
engine's thread, which would otherwise wait for the step in flight (asynchronous scheduling
queues the next step before the last one settles). On the CPU they are bytes at once."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kvcache.tiers import BlockSpec
from kvcache.tiers.writer import Payload
from runner.kv_pool.store import KVStore

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


class CopyDone(Protocol):
    """The point a queued copy has completed at (a CUDA event recorded behind it)."""

    def synchronize(self) -> None:
        """Wait until the copy has completed; raises if it failed."""
        ...


class HostCopies(Protocol):
    """Where a copy of device blocks into host memory is queued."""

    def queue(self, source: torch.Tensor) -> tuple[torch.Tensor, CopyDone]:
        """A host tensor that will hold ``source`` once the returned point completes."""
        ...


class CudaCopies:
    """Copies queued on the current stream (the one the engine's steps run on) into pinned
    memory, without waiting: a non-blocking copy into pageable memory would wait anyway."""

    def queue(self, source: torch.Tensor) -> tuple[torch.Tensor, CopyDone]:
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        host.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done


class _HostCopy:
    """One queued copy of several blocks, shared by their payloads: waited for once."""

    def __init__(self, host: torch.Tensor, done: CopyDone, count: int) -> None:
        self._host, self._done, self._count = host, done, count
        self._rows: np.ndarray | None = None
        self._lock = threading.Lock()  # two threads may ask at once (a writer, a flush)

    def rows(self) -> np.ndarray:
        """[blocks, block bytes] uint8, once the copy has completed (raises if it failed)."""
        with self._lock:
            if self._rows is None:
                self._done.synchronize()
                self._rows = self._host.view(torch.uint8).reshape(self._count, -1).numpy()
            return self._rows


class DeferredBlock:
    """One block's K/V on its way to host memory (kvcache.tiers' ``DeferredBytes``)."""

    def __init__(self, copy: _HostCopy, row: int) -> None:
        self._copy, self._row = copy, row

    def result(self) -> memoryview:
        """The block's bytes, waiting for the copy (a view of the pinned buffer: no copy)."""
        return memoryview(self._copy.rows()[self._row])


class PoolCopies:
    """How the tiers copy one pool's blocks (kvcache/tiers/loader.py's ``PoolBlocks``): off
    the pool at commit and eviction with ``copies`` (a GPU's stream) queued, the payloads
    deferred; without (the CPU), as bytes at once, just as ``read_blocks`` gives them. Tests
    put a device of their own in ``copies``. Loads are written back at once."""

    def __init__(self, kv: KVStore, copies: HostCopies | None) -> None:
        self.kv = kv
        self.copies = copies

    @staticmethod
    def for_pool(kv: KVStore) -> PoolCopies:
        """Queued on CUDA, immediate elsewhere."""
        return PoolCopies(kv, CudaCopies() if kv.device.type == "cuda" else None)

    def read_blocks(self, block_ids: Sequence[int]) -> Sequence[Payload]:
        if self.copies is None:
            return read_blocks(self.kv, block_ids)
        return read_deferred(self.kv, block_ids, self.copies)

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None:
        write_blocks(self.kv, block_ids, payloads)


def read_deferred(kv: KVStore, block_ids: Sequence[int], copies: HostCopies) -> list[DeferredBlock]:
    """Each block's K/V, copied off the pool by a copy queued on ``copies`` (nothing waits).

    Safe though the pool may give a block to another request and the next step overwrite it
    before the copy has run: the gather and the copy are queued on the stream the steps run on,
    now, so they run after every step queued before (whose K/V they must see: a commit's
    blocks are written by the step just queued) and before every step queued after (which
    may write the block again). The device runs a stream's work in the order it was queued."""
    out: list[DeferredBlock] = []
    for start in range(0, len(block_ids), _BLOCKS_PER_COPY):
        chunk = block_ids[start : start + _BLOCKS_PER_COPY]
        ids = _index_on(chunk, kv.device)
        # [layers, 2, n, B, H, D] -> [n, layers, 2, B, H, D]: one block's bytes contiguous
        blocks = kv.tensor.index_select(2, ids).movedim(2, 0).contiguous()
        copy = _HostCopy(*copies.queue(blocks), len(chunk))
        out.extend(DeferredBlock(copy, row) for row in range(len(chunk)))
    return out


def _index_on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as int64 on ``device``; on CUDA from pinned memory without blocking
    (``torch.tensor(values, device=...)`` waits for every kernel queued before it)."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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
