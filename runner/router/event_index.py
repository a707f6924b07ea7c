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
"""

from __future__ import annotations

from collections.abc import Sequence

from runner.kv_events.schema import AllBlocksCleared, BlockStored, EventBatch


class EventIndex:
    """One replica's cached blocks by medium, and where in its event stream the view is."""

    def __init__(self) -> None:
        self.media: dict[str, set[int]] = {}
        self._held: dict[int, int] = {}  # block hash -> how many media hold it
        self.last_seq = -1  # the number of the last batch applied (-1: none)
        self.last_ts = 0.0  # that batch's time stamp (a restarted publisher's are later)

    def __len__(self) -> int:
        """Blocks held in at least one medium."""
        return len(self._held)

    def match(self, hashes: Sequence[int], medium: str | None = None) -> int:
        """How many leading ``hashes`` the replica holds, in any medium (or in ``medium``
        alone). Pure."""
        held: set[int] | dict[int, int] = (
            self._held if medium is None else self.media.get(medium, set())
        )
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def insert(self, hashes: Sequence[int]) -> None:
        """A request routed here: no evidence of what the replica caches (its events are)."""

    def emptied(self) -> EventIndex:
        """A fresh view, for a replica that went away (its stream is followed afresh)."""
        return EventIndex()

    def apply(self, seq: int, batch: EventBatch) -> None:
        """Apply one batch, numbered ``seq``, in stream order. Mutates the view."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                held = self.media.setdefault(event.medium or "GPU", set())
                for block_hash in event.block_hashes:
                    if block_hash not in held:
                        held.add(block_hash)
                        self._held[block_hash] = self._held.get(block_hash, 0) + 1
            elif isinstance(event, AllBlocksCleared):
                self.media.clear()
                self._held.clear()
            else:
                held = self.media.setdefault(event.medium or "GPU", set())
                for block_hash in event.block_hashes:
                    if block_hash in held:
                        held.discard(block_hash)
                        count = self._held.pop(block_hash) - 1
                        if count:
                            self._held[block_hash] = count
        self.last_seq, self.last_ts = seq, batch.ts

    def restart(self) -> None:
        """The publisher started over (a restarted replica): forget the view and its place."""
        self.media.clear()
        self._held.clear()
        self.last_seq, self.last_ts = -1, 0.0

    def counts(self) -> dict[str, int]:
        """Blocks held per medium. Pure."""
        return {medium: len(held) for medium, held in sorted(self.media.items())}
