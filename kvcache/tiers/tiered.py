"""The tiers in order (host, disk, remote): a chain lookup at admission and a bounded
background writer.

Lookup: given a request's block hashes past what the device pool holds, each tier is asked
once for the keys the tiers above it did not have (the remote one in one round trip), and the
longest run of consecutive blocks the values found cover, each block verified
(``block_value.decode_chunk``, then its expected hash, parent and tokens), is the hit. A
tier that fails is a miss, warned once per tier and counted; it never fails the request.

Writes: committed blocks are written through to disk and remote (in chunks of consecutive
blocks, one value each), blocks evicted from the device pool back to the host tier, all on
one daemon thread fed by a queue bounded in blocks: when it is full the write is dropped and
counted, never waited for.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol

from kvcache.tiers.block_value import (
    BlockSpec,
    BlockValue,
    Link,
    Miss,
    decode_chunk,
    encode_chunk,
    expect,
    storage_key,
    value_blocks,
)

log = logging.getLogger(__name__)
# Miss reasons that mean the stored bytes themselves are bad: those values are deleted.
DAMAGED = ("truncated header", "truncated or oversized value", "not a block value", "checksum")
_BATCH = 64  # values the writer thread takes from the queue at a time (one pipeline)


class TierDown(ConnectionError):
    """A tier that cannot be reached now (a miss for the caller, never a failed request)."""


class Tier(Protocol):
    name: str

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...
    def put(self, key: str, value: bytes) -> bool: ...
    def discard(self, key: str) -> None: ...
    def close(self) -> None: ...


@dataclass
class TierCounters:
    """What one tier did so far (all counters only grow)."""

    hit_blocks: int = 0  # blocks served from this tier
    read_bytes: int = 0  # bytes of the values served
    written_blocks: int = 0
    written_values: int = 0  # keys written: a chunk is one value of several blocks
    written_bytes: int = 0
    rejected_blocks: int = 0  # values found but failing their checks (never served)
    errors: int = 0  # calls that failed (I/O error, server down, timeout)
    skipped: int = 0  # calls not made while the tier was backing off


class Pending(NamedTuple):
    """A block to write: its place in the chain and its K/V bytes (copied off the pool)."""

    key: int
    parent: int
    tokens: bytes
    top: bool
    kv: bytes


class Hit(NamedTuple):
    tier: str
    value: BlockValue


class _Job(NamedTuple):
    targets: tuple[str, ...]
    blocks: tuple[Pending, ...]  # one value: consecutive blocks of a chain, keyed by the last


class TieredStore:
    """Tiers below the device pool, in lookup order; owns the writer thread."""

    def __init__(
        self,
        spec: BlockSpec,
        tiers: Sequence[Tier],
        *,
        mac_key: bytes | None = None,
        queue_blocks: int = 256,
        warn: Callable[[str], None] = log.warning,
    ) -> None:
        self.spec = spec
        self.tiers = list(tiers)
        self.mac_key = mac_key
        self.counters = {t.name: TierCounters() for t in self.tiers}
        self.dropped_writes = 0  # blocks not written because the queue was full
        self._warn = warn
        self._warned: set[str] = set()
        # Bounded in blocks (a chunk counts each of its blocks), not in values.
        self._queue: queue.Queue[list[_Job] | None] = queue.Queue()
        self._capacity = queue_blocks
        self._queued_blocks = 0
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tiers", daemon=True)
        self._writer.start()

    def has(self, name: str) -> bool:
        return name in self.counters

    def key_of(self, block_hash: int) -> str:
        return storage_key(self.spec, block_hash)

    # -- lookup --------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int], parent: int, tokens: Sequence[bytes]) -> list[Hit]:
        """The longest run of ``hashes`` (block i's tokens ``tokens[i]``, the first one's parent
        ``parent``) the tiers hold, each value verified, in order, one Hit a block.

        Every block's key is asked for (a value is keyed by its last block, and a chunk may end
        at any of them); each tier once, for the keys the tiers above did not have. Then, from
        the first block on, the value that covers it and reaches furthest is decoded and
        checked block by block against the chain; a value that fails is a miss and the next
        best one is tried."""
        n = len(hashes)
        keys = [self.key_of(h) for h in hashes]
        found: dict[int, tuple[Tier, bytes]] = {}
        for tier in self.tiers:
            want = [i for i in range(n) if i not in found]
            if not want:
                break
            values = self.guarded(tier, partial(tier.get_many, [keys[i] for i in want]))
            for i, value in zip(want, values or [], strict=False):
                if value is not None:
                    found[i] = (tier, value)
        # Where each value starts (read from its header once, not at every block).
        starts = {k: k - value_blocks(data) + 1 for k, (_, data) in found.items()}
        hits: list[Hit] = []
        while len(hits) < n:
            pos = len(hits)
            covering = [k for k, first in starts.items() if k >= pos and first <= pos]
            if not covering:
                break
            last = max(covering)
            del starts[last]
            tier, data = found.pop(last)
            blocks = self._check(tier, keys[last], data, (hashes, tokens, parent), pos, last)
            if blocks is None:
                continue
            counters = self.counters[tier.name]
            counters.hit_blocks += len(blocks)
            counters.read_bytes += len(data)
            hits.extend(Hit(tier.name, block) for block in blocks)
            parent = hashes[last]
        return hits

    def _check(
        self,
        tier: Tier,
        key: str,
        data: bytes,
        chain: tuple[Sequence[int], Sequence[bytes], int],
        pos: int,
        last: int,
    ) -> list[BlockValue] | None:
        """The blocks of ``data`` (found under block ``last``'s key) for chain places ``pos``
        through ``last`` (``chain``: every block's hash and tokens, and the parent of block
        ``pos``); None, counted and warned once, when the value fails any check. A chunk's
        blocks before ``pos`` (held on the device already) are only checked to lead to it."""
        hashes, tokens, parent = chain
        result = decode_chunk(data, self.spec, mac_key=self.mac_key)
        if not isinstance(result, Miss):
            first = last - len(result) + 1  # the value's first block's place in the chain
            wanted = result[pos - first :] if first <= pos else []
            if not wanted:
                result = Miss("its blocks do not reach the block needed")
            for i, block in enumerate(wanted):
                miss = expect(
                    block, key=hashes[pos + i], tokens=tokens[pos + i],
                    parent=parent if i == 0 else hashes[pos + i - 1],
                )  # fmt: skip
                if miss is not None:
                    result = miss
                    break
        if isinstance(result, Miss):
            self.counters[tier.name].rejected_blocks += 1
            self._warn_once(f"reject-{tier.name}", f"{tier.name} tier: {result.reason}")
            if result.reason.startswith(DAMAGED):
                self.guarded(tier, partial(tier.discard, key))
            return None
        return wanted

    def guarded(self, tier: Tier, call: Callable[[], Any]) -> Any:
        """Run one tier call; a failure is counted, warned once, and returns None."""
        counters = self.counters[tier.name]
        try:
            return call()
        except TierDown as err:
            if "backing off" in str(err):
                counters.skipped += 1
            else:
                counters.errors += 1
                self._warn_once(tier.name, f"{tier.name} tier unavailable, read as a miss: {err}")
        except Exception as err:  # noqa: BLE001 - a tier's fault is a miss, never the request's
            counters.errors += 1
            self._warn_once(tier.name, f"{tier.name} tier failed, read as a miss: {err!r}")
        return None

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            self._warn(message)

    # -- writes --------------------------------------------------------------------------------
    def write(self, targets: Sequence[str], blocks: list[Pending]) -> int:
        """Queue ``blocks`` for the tiers named ``targets`` (those configured), one value each;
        returns how many were dropped because the queue was full. Never blocks."""
        return self.write_chunks(targets, [[block] for block in blocks])

    def write_chunks(self, targets: Sequence[str], chunks: Sequence[Sequence[Pending]]) -> int:
        """Queue each chunk (consecutive blocks of one chain, in order) as one value, keyed by
        its last block, for the tiers named ``targets``; returns how many blocks were dropped
        because the queue (bounded in blocks) was full. Never blocks."""
        names = tuple(t for t in targets if t in self.counters)
        if not names:
            return 0
        accepted: list[_Job] = []
        dropped = 0
        with self._lock:  # one lock and one queue item a call: the writer wakes once
            for chunk in chunks:
                if self._queued_blocks + len(chunk) <= self._capacity:
                    self._queued_blocks += len(chunk)
                    accepted.append(_Job(names, tuple(chunk)))
                else:
                    dropped += len(chunk)
        if accepted:
            self._queue.put_nowait(accepted)
        self.dropped_writes += dropped
        return dropped

    def space(self) -> int:
        """How many blocks the write queue has room for now (copying more K/V off the pool
        would be wasted: they would be dropped). Pure."""
        return max(0, self._capacity - self._queued_blocks)

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
                for _ in items:
                    self._queue.task_done()
            if items[-1] is None:
                return

    def _write_jobs(self, jobs: list[_Job]) -> None:
        values = [(self.key_of(job.blocks[-1].key), self._encode(job.blocks)) for job in jobs]
        for tier in self.tiers:
            batch = [v for v, job in zip(values, jobs, strict=True) if tier.name in job.targets]
            if batch:
                self._put_batch(tier, batch)

    def _encode(self, blocks: tuple[Pending, ...]) -> bytes:
        links = [Link(b.key, b.parent, b.tokens) for b in blocks]
        kv = blocks[0].kv if len(blocks) == 1 else b"".join(b.kv for b in blocks)
        return encode_chunk(self.spec, links, kv, top=blocks[0].top, mac_key=self.mac_key)

    def _put_batch(self, tier: Tier, batch: list[tuple[str, bytes]]) -> None:
        """Write values to one tier (one pipeline where the tier has ``put_many``)."""
        put_many = getattr(tier, "put_many", None)
        if put_many is not None:
            done = self.guarded(tier, lambda: put_many(batch) or True)
            written = batch if done else []
        else:
            written = [kv for kv in batch if self.guarded(tier, partial(tier.put, *kv))]
        counters = self.counters[tier.name]
        counters.written_values += len(written)
        counters.written_blocks += sum(value_blocks(value) for _, value in written)
        counters.written_bytes += sum(len(value) for _, value in written)

    def flush(self) -> None:
        """Wait until every queued write is done (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, stop the writer, close the tiers."""
        self._queue.put(None)
        self._writer.join()
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict[str, Any]:
        """Counters per tier and the dropped writes, as plain numbers. Pure."""
        return {
            "tiers": {name: asdict(c) for name, c in self.counters.items()},
            "dropped_writes": self.dropped_writes,
        }
