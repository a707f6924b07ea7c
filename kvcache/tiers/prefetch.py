"""Prefetch: while a request waits in the queue, the blocks of its chain that only the disk or
the remote tier holds are read into the host tier, so that its admission finds them in memory
instead of waiting on a file or a round trip.

One daemon thread, fed by a bounded queue of chains (a full queue drops the prefetch, counted:
the admission then reads the lower tiers itself). Values are copied up as they are, unverified:
the admission's lookup checks every value it serves, whichever tier it comes from.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from kvcache.tiers.block_value import value_blocks
from kvcache.tiers.host import HostTier
from kvcache.tiers.tiered import TieredStore


class Prefetcher:
    """Copies a chain's values from the store's lower tiers into its host tier."""

    def __init__(self, store: TieredStore, host: HostTier, queue_chains: int = 64) -> None:
        self.store, self.host = store, host
        self.lower = [t for t in store.tiers if t is not host]
        self.prefetched_blocks = 0  # values copied up into the host tier
        self.dropped = 0  # chains not prefetched: the queue was full
        # (a chain's block hashes, the first one's place from the chain's top)
        self._queue: queue.Queue[tuple[list[int], int] | None] = queue.Queue(maxsize=queue_chains)
        self._thread = threading.Thread(target=self._loop, name="kv-prefetch", daemon=True)
        self._thread.start()

    def prefetch(self, hashes: Sequence[int], first: int = 0) -> None:
        """Queue a chain (block hashes in order, the first at place ``first`` from its top) to
        be read up. Never blocks."""
        if not hashes or not self.lower:
            return
        try:
            self._queue.put_nowait((list(hashes), first))
        except queue.Full:
            self.dropped += 1

    def _loop(self) -> None:
        while True:
            chain = self._queue.get()
            try:
                if chain is None:
                    return
                self._fetch(*chain)
            finally:
                self._queue.task_done()

    def _fetch(self, hashes: list[int], first: int) -> None:
        """Read up the values of the chain that the lower tiers hold and the host tier lacks,
        up to the chain's first gap in every tier (TieredStore.read_chain): a value past it
        could not be served, and reading it would make it recent in its tier for nothing.
        The admission's lookup decides which of them continue the chain."""
        for key, value in self.store.read_chain(hashes, first, self.lower).items():
            self.host.put(key, value)
            self.prefetched_blocks += value_blocks(value)

    def flush(self) -> None:
        """Wait until every queued chain is read up (tests)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
