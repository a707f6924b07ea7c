"""The block manager's side of the tiers below the device pool: which blocks go down, and how
hits come back up. Pure Python: the K/V copies off and into the pool are the caller's
(`PoolBlocks`: runner/engine/kv/transfer.py for one pool, the tensor-parallel executor for
its ranks).

* Each block a commit adds to the tree is copied off the pool and queued for the
  write-through tiers (disk, remote), in chunks of ``cache_chunk_tokens`` (``_chunks``); each
  block about to be evicted from the pool, for the host tier (write-back). The copy is made at
  once, while the block still holds its K/V; encoding, checksums, MACs and I/O run on the
  store's writer thread. On a GPU the copy is queued behind the step in flight and the writer
  thread waits for it (runner/engine/kv/transfer.py's ``PoolCopies``): a commit or an
  eviction never waits for the device. What the write queue has no room for waits in the pool
  (``WriteBacklog``: a long prompt committed in one step) and is copied at the next commit,
  eviction or flush, oldest first; only a block evicted before then is dropped.
* At admission (``load``, before the block manager's allocate) the request's chain of block
  hashes is followed past the device tree's longest match through the tiers; the verified hits
  are copied into fresh blocks and committed into the tree, as if this engine had computed them,
  and freed. The allocate that follows then finds them cached like any device hit (so
  ``num_cached_tokens`` counts them), and the next request hits on the device.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvcache.block_manager import BlockManager, Purpose
from kvcache.hashing import block_hashes, pack_tokens
from kvcache.radix_tree import Node
from kvcache.tiers.host import HostTier
from kvcache.tiers.prefetch import Prefetcher
from kvcache.tiers.tiered import Pending, TieredStore
from kvcache.tiers.write_backlog import WriteBacklog
from kvcache.tiers.writer import Payload

# The request id the block manager knows a load by: engine sequence ids are never negative.
_LOADING_ID = -1
WRITE_THROUGH = ("disk", "remote")


class PoolBlocks(Protocol):
    """Blocks' K/V copied off the pool (as bytes, or payloads that resolve to them later: a
    copy queued behind a GPU's step) and back into it."""

    def read_blocks(self, block_ids: Sequence[int]) -> Sequence[Payload]: ...

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None: ...


class TierLoader:
    """Moves blocks between one engine's pool and its tiers."""

    def __init__(
        self,
        bm: BlockManager,
        store: TieredStore,
        pool: PoolBlocks,
        block_size: int,
        host: HostTier | None = None,
    ) -> None:
        """`store`: the tiers, opened (runner/engine/kv/tiers.py builds them from the engine's
        options); `pool`: how blocks' K/V are copied off and into the pool (one worker's pool,
        or every tensor-parallel rank's shard joined in rank order); `host`: the store's host
        tier, if it has one (evictions are written back to it)."""
        self.store = store
        self.host = host
        self.chunk_blocks = store.chunk_blocks
        # A waiting request's blocks are read up from disk or Redis into the host tier.
        self.prefetcher = (
            Prefetcher(store, host) if host is not None and len(store.tiers) > 1 else None
        )
        self.bm, self.pool = bm, pool
        self.block_size = block_size
        self._loading = False  # blocks committed by a load came from the tiers: not written back
        self.loaded_blocks = 0
        self.load_seconds = 0.0
        self._write_through = any(self.store.has(t) for t in WRITE_THROUGH)
        # Committed blocks the write queue had no room for yet; it hears of evictions.
        self.backlog = WriteBacklog()
        # At exit, at close (or when this loader is collected) the queued writes still land,
        # and the waiting ones with them.
        self._close = weakref.finalize(
            self, _close, self.prefetcher, self.store, self.backlog, pool.read_blocks
        )
        if self._write_through:
            bm.add_listener(self.backlog)
        watch_evictions = self.store.has("host") or self._write_through
        bm.watch(self._committed, self._evicting if watch_evictions else None)

    # -- down ----------------------------------------------------------------------------------
    @staticmethod
    def _pending(node: Node, kv: Payload) -> Pending:
        parent = node.parent.key if node.parent is not None else node.namespace
        return Pending(node.key, parent, node.tokens, node.parent is None, kv)

    def _committed(self, nodes: list[Node]) -> None:
        if self._loading or not self._write_through:
            return
        self.backlog.add(self._chunks(nodes))
        self._write_backlog()

    def _write_backlog(self) -> None:
        _write_backlog(self.backlog, self.store, self.pool.read_blocks)

    def write_waiting(self) -> None:
        """Queue what waits in the pool and the write queue has room for now. An idle
        engine's thread calls it: otherwise nothing would until the next commit or eviction,
        and an idle server never wrote them."""
        if len(self.backlog):
            self._write_backlog()

    def _chunks(self, nodes: list[Node]) -> list[list[Node]]:
        """The values a commit's new nodes go down as. Chunks are aligned on the chain (chunk i
        is blocks i*C .. i*C+C-1, C = chunk_blocks), so every engine cuts a chain the same way:
        each chunk a new node completes is written whole, with its blocks committed earlier;
        the new nodes past the last one completed, one block a value. Those are where a prompt
        ends, and a later prompt that shares only part of their chunk (a system prompt, then
        another question) finds them by their own hashes: a partial chunk keyed by its last
        block would be found only by a prompt equal up to that block. Pure."""
        C = self.chunk_blocks
        out: list[list[Node]] = []
        tail_from, depth, previous = 0, -1, None
        for i, node in enumerate(nodes):
            depth = depth + 1 if previous is not None and node.parent is previous else _depth(node)
            previous = node
            if (depth + 1) % C == 0:
                chunk = [node]
                while len(chunk) < C and chunk[-1].parent is not None:
                    chunk.append(chunk[-1].parent)
                out.append(chunk[::-1])
                tail_from = i + 1
        out.extend([node] for node in nodes[tail_from:])
        return out

    def _evicting(self, nodes: list[Node]) -> None:
        """Before an allocation evicts ``nodes`` (their K/V still intact): the waiting
        write-through values the queue has room for go first (they may be among them), then
        the host tier's write-back of the evicted blocks, in one copy off the pool. A block
        the host tier holds already (loaded from it, or prefetched into it) is not copied
        again."""
        if len(self.backlog):
            self._write_backlog()
        if self.host is None:
            return
        host, store = self.host, self.store
        fresh = [n for n in nodes if store.key_of(n.key) not in host]
        room = min(len(fresh), store.space())
        store.count_dropped(len(fresh) - room)
        if not room:
            return
        fresh = fresh[:room]
        payloads = self.pool.read_blocks([n.block_id for n in fresh])
        store.write(("host",), [self._pending(n, p) for n, p in zip(fresh, payloads, strict=True)])

    # -- up ------------------------------------------------------------------------------------
    def _on_device(self, token_ids: Sequence[int], root: int) -> int:
        """How many of the prompt's blocks the device tree matches. Pure."""
        return -(-len(token_ids) // self.block_size) - self.bm.blocks_needed(token_ids, root)

    def _chain_past_device(self, token_ids: Sequence[int], root: int) -> tuple[int, list[int]]:
        """(blocks the device tree matches, every loadable block's hash). Pure."""
        B = self.block_size
        max_blocks = (len(token_ids) - 1) // B  # as BlockCache.match: one token is computed
        on_device = self._on_device(token_ids, root)
        if on_device >= max_blocks:
            return on_device, []
        return on_device, block_hashes(token_ids[: max_blocks * B], B, root)

    def prefetch(self, token_ids: Sequence[int], root: int) -> None:
        """Start reading a queued request's blocks up into the host tier (Scheduler.add)."""
        if self.prefetcher is not None:
            on_device, hashes = self._chain_past_device(token_ids, root)
            self.prefetcher.prefetch(hashes[on_device:], on_device)

    def load(self, token_ids: Sequence[int], root: int) -> int:
        """Load the tiers' blocks that continue the device tree's longest match of this prompt
        into the pool (as cached blocks); returns how many. Loads fewer when the pool cannot
        spare the blocks (nothing held is ever evicted for it)."""
        started = time.perf_counter()  # lookup and copy are timed; allocation (evictions) not
        on_device, hashes = self._chain_past_device(token_ids, root)
        if not hashes:
            return 0
        B = self.block_size
        max_blocks = len(hashes)
        packed = pack_tokens(token_ids[: max_blocks * B])
        width = len(packed) // max_blocks
        blocks = [packed[i * width : (i + 1) * width] for i in range(on_device, max_blocks)]
        parent = hashes[on_device - 1] if on_device else root
        hits = self.store.lookup(hashes[on_device:], parent, blocks, on_device)
        lookup_s = time.perf_counter() - started
        return self._install(token_ids, root, on_device, [hit.value.kv for hit in hits], lookup_s)

    def install(
        self, token_ids: Sequence[int], root: int, first: int, kvs: Sequence[bytes | memoryview]
    ) -> int:
        """Put checked K/V (``kvs``: blocks ``first``, ``first + 1``, ... of this prompt's
        chain, from a handover) into the pool as cached blocks, those the device tree lacks;
        returns how many blocks of ``kvs`` the tree holds afterwards. The tree must hold the
        blocks before ``first`` (else none is put: 0). ``token_ids``: at least the blocks'
        tokens and one more (as at admission, the block of a prompt's last token is never
        taken)."""
        end = min(first + len(kvs), (len(token_ids) - 1) // self.block_size)
        on_device = self._on_device(token_ids, root)
        if on_device < first:
            return 0
        if on_device >= end:
            return end - first
        probe = token_ids[: end * self.block_size + 1]
        fresh = kvs[on_device - first : end - first]
        return on_device - first + self._install(probe, root, on_device, fresh, 0.0)

    def _install(
        self,
        token_ids: Sequence[int],
        root: int,
        on_device: int,
        kvs: Sequence[bytes | memoryview],
        elapsed: float,
    ) -> int:
        """Copy ``kvs`` (blocks ``on_device``, ... of the chain, the device tree holding those
        before) into fresh blocks and commit them, as many as the pool can spare; how many."""
        B, bm = self.block_size, self.bm
        n = len(kvs)
        while n and not bm.can_allocate(self._probe(token_ids, on_device + n), root):
            n -= 1  # the pool cannot spare that many now
        if n:
            probe = self._probe(token_ids, on_device + n)
            alloc = bm.allocate(_LOADING_ID, probe, root, Purpose.LOADING)
            try:
                fresh = alloc.block_table[on_device : on_device + n]
                copy_started = time.perf_counter()
                self.pool.write_blocks(fresh, kvs[:n])
                elapsed += time.perf_counter() - copy_started
                self._loading = True
                bm.commit(_LOADING_ID, probe, (on_device + n) * B)
            finally:
                self._loading = False
                bm.free(_LOADING_ID)
        if n:  # the time of loads that found something (a miss costs its lookup alone)
            self.loaded_blocks += n
            self.load_seconds += elapsed
        return n

    def _probe(self, token_ids: Sequence[int], num_blocks: int) -> list[int]:
        """The first ``num_blocks`` blocks and one token more: allocate matches every one of
        those blocks and takes one more for that token."""
        return list(token_ids[: num_blocks * self.block_size + 1])

    # -- reports -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per tier: hit tokens and blocks, bytes and blocks read and written, rejected values,
        errors; the dropped writes; the time a loaded block took. Pure."""
        out = self.store.stats()
        for counters in out["tiers"].values():
            counters["hit_tokens"] = counters["hit_blocks"] * self.block_size
        out["prefetched_blocks"] = self.prefetcher.prefetched_blocks if self.prefetcher else 0
        out["waiting_writes"] = self.backlog.blocks  # committed, waiting for the write queue
        out["loaded_blocks"] = self.loaded_blocks
        out["load_ms_per_block"] = (
            1000 * self.load_seconds / self.loaded_blocks if self.loaded_blocks else 0.0
        )
        return out

    def flush(self) -> None:
        """Wait for every queued write and prefetch, the waiting ones included (tests; a
        process about to hand its tiers to another). On the engine's thread, between steps:
        it copies waiting blocks off the pool."""
        if self.prefetcher is not None:
            self.prefetcher.flush()
        while True:  # each round empties the queue, so the next takes at least one value
            self._write_backlog()
            self.store.flush()
            if not len(self.backlog):
                return

    def close(self) -> None:
        """Finish queued writes and close the tiers."""
        self._close()


def _depth(node: Node) -> int:
    """A node's place in its chain (0: a top block). Pure."""
    depth = 0
    while node.parent is not None:
        node, depth = node.parent, depth + 1
    return depth


def _write_backlog(
    backlog: WriteBacklog, store: TieredStore, read: Callable[[Sequence[int]], Sequence[Payload]]
) -> None:
    """Copy off the pool and queue, in one copy, the oldest waiting values the write queue
    has room for; the rest wait (their blocks stay in the pool)."""
    chunks, dropped = backlog.take(store.space(), store.capacity)
    store.count_dropped(dropped)
    if not chunks:
        return
    payloads = iter(read([n.block_id for chunk in chunks for n in chunk]))
    store.write_chunks(
        WRITE_THROUGH,
        [[TierLoader._pending(n, next(payloads)) for n in chunk] for chunk in chunks],
    )


def _close(
    prefetcher: Prefetcher | None,
    store: TieredStore,
    backlog: WriteBacklog,
    read: Callable[[Sequence[int]], Sequence[Payload]],
) -> None:
    if prefetcher is not None:
        prefetcher.close()
    while len(backlog):  # each round frees the queue, so the next takes a value at least
        _write_backlog(backlog, store, read)
        store.flush()
    store.close()
