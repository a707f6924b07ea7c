"""The tiers' bounded background writer: committed blocks written through to disk and remote
(in chunks of consecutive blocks, one value each), blocks evicted from the device pool back to
the host tier, all on one daemon thread fed by a queue bounded in blocks. When the queue is
full a write is dropped and counted, never waited for: a step must not stall on a slow disk or
a slow Redis, and a block not written is only a later miss.

A block's K/V may come as ``DeferredBytes``: a copy off a GPU queued behind the step in flight
(runner/engine/kv/transfer.py). The writer thread waits for it, when it encodes the value;
the engine's thread never does. A copy that fails is a value not written (counted as failed),
never a value with other bytes. A lookup of a block whose value is queued and not written yet
waits for that write (``wait_written``): the engine never misses a block it has just let go,
nor recomputes it, for want of a few milliseconds."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol

from kvcache.tiers.block_value import value_blocks

log = logging.getLogger(__name__)
_BATCH = 64  # values the writer thread takes from the queue at a time (one pipeline)


class TierDown(ConnectionError):
    """A tier that cannot be reached now (a miss for the caller, never a failed request)."""


class Tier(Protocol):
    name: str

    def has_many(self, keys: Sequence[str]) -> list[bool]: ...
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...
    def put(self, key: str, value: bytes) -> bool: ...
    def discard(self, key: str) -> None: ...
    def close(self) -> None: ...


class DeferredBytes(Protocol):
    """Bytes being copied (a block's K/V on its way off a GPU, behind the step in flight)."""

    def result(self) -> bytes | memoryview:
        """Wait for the copy to complete and return its bytes; raises if the copy failed."""
        ...


Payload = bytes | memoryview | DeferredBytes


def payload_bytes(kv: Payload) -> bytes | memoryview:
    """A payload's bytes, waiting for them when they are still being copied."""
    return kv if isinstance(kv, bytes | memoryview) else kv.result()


class Pending(NamedTuple):
    """A block to write: its place in the chain and its K/V bytes (copied off the pool, or
    being copied: the writer thread waits for them)."""

    key: int
    parent: int
    tokens: bytes
    top: bool
    kv: Payload


class _Job(NamedTuple):
    targets: tuple[str, ...]
    blocks: tuple[Pending, ...]  # one value: consecutive blocks of a chain, keyed by the last


# A value to write: its storage key and its encoded bytes.
Encoder = Callable[[tuple[Pending, ...]], tuple[str, bytes]]
# One tier call, its failure counted and warned (TieredStore.guarded; the flag: a write):
# the result, or None.
Guard = Callable[[Tier, Callable[[], Any], bool], Any]
# What a tier's written values add to its counters: (tier name, values, blocks, bytes).
Written = Callable[[str, int, int, int], None]


class TierWriter:
    """Owns the queue and the thread that drains it into ``tiers``."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        encode: Encoder,
        guarded: Guard,
        written: Written,
        queue_blocks: int = 256,
    ) -> None:
        self.tiers = list(tiers)
        self.names = {tier.name for tier in self.tiers}
        self.dropped = 0  # blocks not written because the queue was full
        self.failed = 0  # blocks not written because their value could not be encoded
        self._encode, self._guarded, self._written = encode, guarded, written
        # Bounded in blocks (a chunk counts each of its blocks), not in values.
        self._queue: queue.Queue[list[_Job] | None] = queue.Queue()
        self._capacity = queue_blocks
        self._queued_blocks = 0
        self._queued_keys: dict[int, int] = {}  # block hash -> queued values holding it
        self._lock = threading.Lock()
        self._written_some = threading.Condition(self._lock)  # a batch of values went
        self._thread = threading.Thread(target=self._write_loop, name="kv-tiers", daemon=True)
        self._thread.start()

    def write_chunks(self, targets: Sequence[str], chunks: Sequence[Sequence[Pending]]) -> int:
        """Queue each chunk (consecutive blocks of one chain, in order) as one value, keyed by
        its last block, for the tiers named ``targets``; returns how many blocks were dropped
        because the queue (bounded in blocks) was full. Never blocks."""
        names = tuple(t for t in targets if t in self.names)
        if not names:
            return 0
        accepted: list[_Job] = []
        dropped = 0
        with self._lock:  # one lock and one queue item a call: the writer wakes once
            for chunk in chunks:
                if self._queued_blocks + len(chunk) <= self._capacity:
                    self._queued_blocks += len(chunk)
                    accepted.append(_Job(names, tuple(chunk)))
                    for block in chunk:
                        self._queued_keys[block.key] = self._queued_keys.get(block.key, 0) + 1
                else:
                    dropped += len(chunk)
        if accepted:
            self._queue.put_nowait(accepted)
        self.dropped += dropped
        return dropped

    @property
    def capacity(self) -> int:
        """How many blocks the queue holds at most. Pure."""
        return self._capacity

    def space(self) -> int:
        """How many blocks the queue has room for now. Pure."""
        return max(0, self._capacity - self._queued_blocks)

    def wait_written(self, keys: Sequence[int]) -> None:
        """Wait until no value holding one of the blocks ``keys`` is queued: each one queued is
        then in its tiers (or failed). What a lookup of those blocks must see: a block the pool
        let go a moment ago is otherwise found in no tier while its copy is on its way."""
        with self._written_some:
            while self._queued_keys and any(key in self._queued_keys for key in keys):
                self._written_some.wait()

    def _forget(self, jobs: list[_Job]) -> None:
        """The written (or failed) jobs' blocks are queued no longer. Under the lock."""
        for job in jobs:
            for block in job.blocks:
                left = self._queued_keys[block.key] - 1
                if left:
                    self._queued_keys[block.key] = left
                else:
                    del self._queued_keys[block.key]

    def _write_loop(self) -> None:
        """Take the queued jobs (each queue item is one call's), up to about _BATCH, and write
        them: one pipeline per tier for a batch."""
        while True:
            items = [self._queue.get()]
            jobs = list(items[0] or [])
            while len(jobs) < _BATCH and items[-1] is not None:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                jobs.extend(items[-1] or [])
            try:
                self._write_jobs(jobs)
            finally:
                with self._lock:
                    self._queued_blocks -= sum(len(job.blocks) for job in jobs)
                    self._forget(jobs)
                    self._written_some.notify_all()
                for _ in items:
                    self._queue.task_done()
            if items[-1] is None:
                return

    def _write_jobs(self, jobs: list[_Job]) -> None:
        encoded: list[tuple[_Job, tuple[str, bytes]]] = []
        for job in jobs:
            try:
                encoded.append((job, self._encode(job.blocks)))
            except Exception:  # noqa: BLE001 - the writer thread must outlive any one value
                # A dead writer would leave every later write queued and every flush waiting.
                # A copy off the device that failed lands here too: a miss, never other K/V.
                if not self.failed:  # the first one with its traceback; the rest counted
                    log.exception(
                        "kv-tiers: a value could not be copied or encoded; it is not written"
                    )
                self.failed += len(job.blocks)
        for tier in self.tiers:
            batch = [value for job, value in encoded if tier.name in job.targets]
            if batch:
                self._put_batch(tier, batch)

    def _put_batch(self, tier: Tier, batch: list[tuple[str, bytes]]) -> None:
        """Write values to one tier (one pipeline where the tier has ``put_many``)."""
        put_many = getattr(tier, "put_many", None)
        if put_many is not None:
            done = self._guarded(tier, lambda: put_many(batch) or True, True)
            written = batch if done else []
        else:
            written = [kv for kv in batch if self._guarded(tier, partial(tier.put, *kv), True)]
        blocks = sum(value_blocks(value) for _, value in written)
        self._written(tier.name, len(written), blocks, sum(len(value) for _, value in written))

    def flush(self) -> None:
        """Wait until every queued write is done (tests, shutdown)."""
        self._queue.join()

    def stop(self) -> None:
        """Finish the queued writes, then stop the thread."""
        self._queue.put(None)
        self._thread.join()
