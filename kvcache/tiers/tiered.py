"""The tiers in order (host, disk, remote): a chain lookup at admission and a bounded
background writer.

Lookup: given a request's block hashes past what the device pool holds, each tier is asked
once for the keys the tiers above it did not have (the remote one in one round trip), and the
longest run of consecutive blocks the values found cover, each block verified
(``block_value.decode_chunk``, then its expected hash, parent and tokens), is the hit. A
tier that fails is a miss, warned once per tier and counted; it never fails the request.

Writes: committed blocks through to disk and remote, evicted ones back to the host tier, on
the bounded background writer (tier_writer.py), which drops a write rather than wait for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NamedTuple

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
from kvcache.tiers.tier_writer import Pending, Tier, TierDown, TierWriter

__all__ = ["Hit", "Pending", "Tier", "TierCounters", "TierDown", "TieredStore"]

log = logging.getLogger(__name__)
# Miss reasons that mean the stored bytes themselves are bad: those values are deleted.
DAMAGED = ("truncated header", "truncated or oversized value", "not a block value", "checksum")


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
        warn: Callable[[str], None] = log.warning,
    ) -> None:
        self.spec = spec
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
        """Queue each chunk (consecutive blocks of one chain, in order) as one value for the
        tiers named ``targets``; how many blocks were dropped (TierWriter.write_chunks)."""
        return self.writer.write_chunks(targets, chunks)

    def space(self) -> int:
        """How many blocks the write queue has room for now (copying more K/V off the pool
        would be wasted: they would be dropped). Pure."""
        return self.writer.space()

    def count_dropped(self, blocks: int) -> None:
        """Blocks a caller did not queue because there was no room (counted as dropped)."""
        self.writer.dropped += blocks

    @property
    def dropped_writes(self) -> int:
        return self.writer.dropped

    def _encode(self, blocks: tuple[Pending, ...]) -> tuple[str, bytes]:
        links = [Link(b.key, b.parent, b.tokens) for b in blocks]
        kv = blocks[0].kv if len(blocks) == 1 else b"".join(b.kv for b in blocks)
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
        }
