"""The tiers in order (host, disk, remote): a chain lookup at admission and a bounded
background writer.

Lookup: given a request's block hashes past what the device pool holds, each tier is asked
once which of the keys the tiers above it lack it holds (nothing read nor made recent; the
remote one in one round trip), then only the values that continue the chain up to its first
gap are read (chain_reads.py), and the longest run of consecutive blocks they cover, each
block verified (``block_value.decode_chunk``, then its expected hash, parent and tokens), is
the hit. A tier that fails is a miss, warned once per tier and counted (its URL's password
never shown); it never fails the request.

Writes: committed blocks through to disk and remote, evicted ones back to the host tier, on
the bounded background writer (writer.py), which drops a write rather than wait for it
(the engine keeps what does not fit yet waiting in its pool: write_backlog.py). A block's K/V
may still be on its way off the GPU when it is queued (``DeferredBytes``): the writer thread
waits for it, and a lookup of a block whose write is queued waits for that write first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NamedTuple, TypeVar

from kvcache.redaction import redact_text
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
from kvcache.tiers.chain_reads import plan_reads
from kvcache.tiers.writer import Pending, Tier, TierDown, TierWriter, payload_bytes

T = TypeVar("T")  # what a guarded tier call returns

__all__ = ["Hit", "Pending", "Tier", "TierCounters", "TierDown", "TieredStore"]

log = logging.getLogger(__name__)
# Miss reasons that mean the stored bytes themselves are bad: those values are deleted.
DAMAGED = ("truncated header", "truncated or oversized value", "not a block value", "checksum")


@dataclass
class TierCounters:
    """What one tier did so far (all counters only grow)."""

    hit_blocks: int = 0  # blocks served from this tier
    read_bytes: int = 0  # bytes of the values served
    fetched_values: int = 0  # values read from the tier (served or not: checks, prefetch)
    fetched_bytes: int = 0
    written_blocks: int = 0
    written_values: int = 0  # keys written: a chunk is one value of several blocks
    written_bytes: int = 0
    rejected_blocks: int = 0  # values found but failing their checks (never served)
    errors: int = 0  # calls that failed (I/O error, server down, timeout)
    skipped: int = 0  # calls not made while the tier was backing off


class Hit(NamedTuple):
    tier: str
    value: BlockValue


class TieredStore:
    """Tiers below the device pool, in lookup order; owns the writer thread."""

    def __init__(
        self,
        spec: BlockSpec,
        tiers: Sequence[Tier],
        *,
        mac_key: bytes | None = None,
        queue_blocks: int = 256,
        chunk_blocks: int = 16,
        warn: Callable[[str], None] = log.warning,
    ) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        self.spec = spec
        self.chunk_blocks = chunk_blocks  # how the writers cut a chain (chain_reads.py)
        self.tiers = list(tiers)
        self.mac_key = mac_key
        self.counters = {t.name: TierCounters() for t in self.tiers}
        self._warn = warn
        self._warned: set[str] = set()
        self.writer = TierWriter(self.tiers, self._encode, self.guarded, self._count_written,
                                 queue_blocks)  # fmt: skip

    def has(self, name: str) -> bool:
        return name in self.counters

    def key_of(self, block_hash: int) -> str:
        return storage_key(self.spec, block_hash)

    # -- lookup --------------------------------------------------------------------------------
    def lookup(
        self, hashes: Sequence[int], parent: int, tokens: Sequence[bytes], first: int = 0
    ) -> list[Hit]:
        """The longest run of ``hashes`` (block i's tokens ``tokens[i]``, the first one's parent
        ``parent``, its place in the chain from the top ``first``) the tiers hold, each value
        verified, in order, one Hit a block.

        Each tier is asked once which keys it holds (of those the tiers above lack), without
        reading or refreshing anything; then only the values that continue the chain are read
        (chain_reads.py): nothing past the chain's first gap. Then, from the first block on, the
        value read that covers it and reaches furthest is decoded and checked block by block
        against the chain; a value that fails (or went meanwhile) is a miss, and the run goes
        on with another value for the same block if a tier holds one (one more read). A value
        shorter than the plan assumed (the host tier's single blocks) is kept for its own
        place."""
        n = len(hashes)
        # A block let go a moment ago may be queued still (its K/V maybe still being copied
        # off the GPU): wait for its write, which is then in its tier, rather than miss it.
        self.writer.wait_written(hashes)
        keys = [self.key_of(h) for h in hashes]
        holders = self._holders(keys)
        tried: set[int] = set()  # places whose value was asked for: never asked again
        known: dict[int, tuple[int, Tier, bytes]] = {}  # read, not used yet: (its first, ...)
        hits: list[Hit] = []
        while len(hits) < n:
            pos = len(hits)
            covering = [k for k, (start, _, _) in known.items() if k >= pos >= start]
            if not covering:  # read the values that continue the chain from pos
                plan = plan_reads(holders, tried, pos, n, first, self.chunk_blocks)
                if not plan:
                    break
                tried.update(plan)
                for k, (tier, data) in self._read(keys, plan, holders).items():
                    known[k] = (k - value_blocks(data) + 1, tier, data)
                continue
            last = max(covering)  # the value that covers pos and reaches furthest
            _, tier, data = known.pop(last)
            blocks = self._check(tier, keys[last], data, (hashes, tokens, parent), pos, last)
            if blocks is None:
                continue
            counters = self.counters[tier.name]
            counters.hit_blocks += len(blocks)
            counters.read_bytes += len(data)
            hits.extend(Hit(tier.name, block) for block in blocks)
            parent = hashes[last]
        return hits

    def read_chain(
        self, hashes: Sequence[int], first: int, tiers: Sequence[Tier]
    ) -> dict[str, bytes]:
        """The values ``tiers`` (some of this store's) hold that continue a chain (``hashes``,
        the first at place ``first`` from the top) as far as every tier's keys reach, by
        storage key, unverified: what a prefetch copies up. Nothing past the first gap."""
        keys = [self.key_of(h) for h in hashes]
        holders = self._holders(keys)
        planned = plan_reads(holders, (), 0, len(keys), first, self.chunk_blocks)
        plan = [i for i in planned if holders[i] in tiers]
        return {keys[i]: data for i, (_, data) in self._read(keys, plan, holders).items()}

    def _holders(self, keys: Sequence[str]) -> dict[int, Tier]:
        """Place -> the first tier that holds its key, each tier asked once (for the keys the
        tiers above lack), nothing read nor made recent."""
        holders: dict[int, Tier] = {}
        for tier in self.tiers:
            want = [i for i in range(len(keys)) if i not in holders]
            if not want:
                break
            present = self.guarded(tier, partial(tier.has_many, [keys[i] for i in want]))
            for i, has in zip(want, present or [], strict=False):
                if has:
                    holders[i] = tier
        return holders

    def _read(
        self, keys: Sequence[str], plan: Sequence[int], holders: dict[int, Tier]
    ) -> dict[int, tuple[Tier, bytes]]:
        """The planned places' values, one ``get_many`` per tier; a value gone meanwhile (an
        LRU eviction) or a tier that fails is absent."""
        found: dict[int, tuple[Tier, bytes]] = {}
        for tier in self.tiers:
            mine = [i for i in plan if holders[i] is tier]
            if not mine:
                continue
            values = self.guarded(tier, partial(tier.get_many, [keys[i] for i in mine]))
            counters = self.counters[tier.name]
            for i, value in zip(mine, values or [], strict=False):
                if value is not None:
                    found[i] = (tier, value)
                    counters.fetched_values += 1
                    counters.fetched_bytes += len(value)
        return found

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

    def guarded(self, tier: Tier, call: Callable[[], T], writing: bool = False) -> T | None:
        """Run one tier call; a failure is counted, warned once (per tier, and apart for
        reads and writes: what it costs differs), and returns None."""
        counters = self.counters[tier.name]
        outcome = "a write failed, the value is not stored" if writing else "read as a miss"
        topic = f"{tier.name}-write" if writing else tier.name
        try:
            return call()
        except TierDown as err:
            if "backing off" in str(err):
                counters.skipped += 1
            else:
                counters.errors += 1
                self._warn_once(topic, f"{tier.name} tier unavailable, {outcome}: {err}")
        except Exception as err:  # noqa: BLE001 - a tier's fault is a miss, never the request's
            counters.errors += 1
            self._warn_once(topic, f"{tier.name} tier failed, {outcome}: {err!r}")
        return None

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            # An error's text (from redis-py, say) may quote a tier's URL and its password.
            urls = [url for tier in self.tiers if isinstance(url := getattr(tier, "url", ""), str)]
            self._warn(redact_text(message, urls))

    # -- writes --------------------------------------------------------------------------------
    def write(self, targets: Sequence[str], blocks: list[Pending]) -> int:
        """Queue ``blocks`` for the tiers named ``targets`` (those configured), one value each;
        returns how many were dropped because the queue was full. Never blocks."""
        return self.write_chunks(targets, [[block] for block in blocks])

    def write_chunks(self, targets: Sequence[str], chunks: Sequence[Sequence[Pending]]) -> int:
        """Queue each chunk (consecutive blocks of one chain, in order) as one value for the
        tiers named ``targets``; how many blocks were dropped (TierWriter.write_chunks)."""
        return self.writer.write_chunks(targets, chunks)

    def space(self) -> int:
        """How many blocks the write queue has room for now (copying more K/V off the pool
        would be wasted: they would be dropped). Pure."""
        return self.writer.space()

    @property
    def capacity(self) -> int:
        """How many blocks the write queue holds at most (a value larger never goes). Pure."""
        return self.writer.capacity

    def count_dropped(self, blocks: int) -> None:
        """Blocks a caller did not queue because there was no room (counted as dropped)."""
        self.writer.dropped += blocks

    @property
    def dropped_writes(self) -> int:
        return self.writer.dropped

    def _encode(self, blocks: tuple[Pending, ...]) -> tuple[str, bytes]:
        """On the writer thread: a payload still being copied off the GPU is waited for here,
        and a failed copy raises (the value is not written)."""
        links = [Link(b.key, b.parent, b.tokens) for b in blocks]
        if len(blocks) == 1:
            kv = payload_bytes(blocks[0].kv)
        else:
            kv = b"".join(payload_bytes(b.kv) for b in blocks)
        value = encode_chunk(self.spec, links, kv, top=blocks[0].top, mac_key=self.mac_key)
        return self.key_of(blocks[-1].key), value

    def _count_written(self, tier: str, values: int, blocks: int, nbytes: int) -> None:
        counters = self.counters[tier]
        counters.written_values += values
        counters.written_blocks += blocks
        counters.written_bytes += nbytes

    def flush(self) -> None:
        """Wait until every queued write is done (tests, shutdown)."""
        self.writer.flush()

    def close(self) -> None:
        """Finish the queued writes, stop the writer, close the tiers."""
        self.writer.stop()
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict[str, Any]:
        """Counters per tier and the dropped writes, as plain numbers. Pure."""
        return {
            "tiers": {name: asdict(c) for name, c in self.counters.items()},
            "dropped_writes": self.dropped_writes,
            "failed_writes": self.writer.failed,
        }
