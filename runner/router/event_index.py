"""What one replica's KV cache holds, as its KV events say (`kvcache router --kv-events`): the
block hashes of each medium (the device pool "GPU", the host tier "CPU", the disk tier "DISK"),
built from the replica's BlockStored / BlockRemoved / AllBlocksCleared events instead of from
what the router sent it. The hashes are the replica's own chained block hashes, so a prompt
hashed as the engine hashes it (prompt_hashes.py) matches them as it matches a PrefixIndex.

A block in any medium counts as held: the engine loads a prompt's blocks from its tiers at
admission, past what its pool holds, along the same chain. Between replicas that hold as much,
the one holding more of it in its pool goes first (policy.py): a tier's block costs a copy.
The feed that applies the events (event_feed.py) keeps the sequence numbers here, so a view
and its place in the stream are replaced together when a replica goes away.

Bounded, as the routed-prefix index is: at most `capacity` hashes (DEFAULT_CAPACITY, 2^20);
past it the least recently announced eighth is forgotten (a forgotten block only costs a match
the router no longer sees); events of a medium other than the three are ignored and counted, since a
medium's name is the publisher's to choose (2,001 invented names were each kept before).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import islice

from runner.kv_events.schema import MEDIA, MEDIUM_POOL, AllBlocksCleared, BlockStored, EventBatch

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 1 << 20  # hashes per replica, as PrefixIndex: ~16M tokens at 16 a block
_BIT = {medium: 1 << i for i, medium in enumerate(MEDIA)}  # a hash's media, as bits


class EventIndex:
    """One replica's cached blocks by medium, and where in its event stream the view is."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, name: str = "a replica") -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity, self.name = capacity, name
        self._held: dict[int, int] = {}  # hash -> its media's bits, least recent first
        self._counts = dict.fromkeys(MEDIA, 0)  # blocks held per medium
        self.forgotten = 0  # blocks dropped past `capacity`
        self.ignored = 0  # events of an unknown medium
        self.last_seq = -1  # the number of the last batch applied (-1: none)
        self.last_ts = 0.0  # that batch's time stamp (a restarted publisher's are later)

    def __len__(self) -> int:
        """Blocks held in at least one medium."""
        return len(self._held)

    def match(self, hashes: Sequence[int], medium: str | None = None) -> int:
        """How many leading ``hashes`` the replica holds, in any medium (or in ``medium``
        alone). Pure."""
        bits = _BIT.get(medium, 0) if medium is not None else -1
        held = self._held
        count = 0
        for h in hashes:
            if not held.get(h, 0) & bits:
                break
            count += 1
        return count

    def insert(self, hashes: Sequence[int]) -> None:
        """A request routed here: no evidence of what the replica caches (its events are)."""

    def emptied(self) -> EventIndex:
        """A fresh view, for a replica that went away (its stream is followed afresh)."""
        return EventIndex(self.capacity, self.name)

    def apply(self, seq: int, batch: EventBatch) -> None:
        """Apply one batch, numbered ``seq``, in stream order. Mutates the view."""
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._clear()
                continue
            medium = event.medium or MEDIUM_POOL
            bit = _BIT.get(medium)
            if bit is None:
                self._ignore(medium)
            elif isinstance(event, BlockStored):
                self._store(event.block_hashes, medium, bit)
            else:
                self._remove(event.block_hashes, medium, bit)
        self.last_seq, self.last_ts = seq, batch.ts

    def _store(self, hashes: Sequence[int], medium: str, bit: int) -> None:
        for block_hash in hashes:
            bits = self._held.pop(block_hash, 0)  # put back last: the most recently announced
            if not bits & bit:
                self._counts[medium] += 1
            self._held[block_hash] = bits | bit
            if len(self._held) > self.capacity:
                self._forget(len(self._held) - self.capacity + self.capacity // 8)

    def _forget(self, count: int) -> None:
        """Forget the `count` least recently announced blocks. An eighth of the capacity at a
        time, so the copy of what is kept (a dict, half an OrderedDict's memory a hash) is paid
        once per capacity / 8 blocks announced."""
        if not self.forgotten:
            log.warning(
                "%s: its KV events announce more than %d blocks: the least recently announced "
                "are forgotten",
                self.name,
                self.capacity,
            )
        entries = iter(self._held.items())
        for _, bits in islice(entries, count):
            for medium, medium_bit in _BIT.items():
                if bits & medium_bit:
                    self._counts[medium] -= 1
        self._held = dict(entries)  # the rest, in their order
        self.forgotten += count

    def _remove(self, hashes: Sequence[int], medium: str, bit: int) -> None:
        held = self._held
        for block_hash in hashes:
            bits = held.get(block_hash, 0)
            if bits & bit:
                self._counts[medium] -= 1
                if bits == bit:
                    del held[block_hash]
                else:
                    held[block_hash] = bits & ~bit

    def _ignore(self, medium: str) -> None:
        if not self.ignored:
            log.warning(
                "%s: KV events of medium %r are ignored (known: %s)",
                self.name,
                medium[:64],
                ", ".join(MEDIA),
            )
        self.ignored += 1

    def _clear(self) -> None:
        self._held.clear()
        self._counts = dict.fromkeys(MEDIA, 0)

    def restart(self) -> None:
        """The publisher started over (a restarted replica): forget the view and its place."""
        self._clear()
        self.last_seq, self.last_ts = -1, 0.0

    def blocks(self, medium: str = MEDIUM_POOL) -> set[int]:
        """The hashes held in ``medium``. Pure."""
        bit = _BIT.get(medium, 0)
        return {block_hash for block_hash, bits in self._held.items() if bits & bit}

    def counts(self) -> dict[str, int]:
        """Blocks held per medium (those holding any). Pure."""
        return {medium: n for medium, n in sorted(self._counts.items()) if n}
