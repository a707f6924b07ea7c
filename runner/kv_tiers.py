"""The engine's side of the tiers below the device pool (kvcache/tiers): which blocks go down,
and how hits come back up.

* Each block a commit adds to the tree is copied off the pool and queued for the write-through
  tiers (disk, remote); each block about to be evicted from the pool, for the host tier
  (write-back). The copy is made at once, while the block still holds its K/V; encoding,
  checksums, MACs and I/O run on the store's writer thread.
* At admission (``load``, before the block manager's allocate) the request's chain of block
  hashes is followed past the device tree's longest match through the tiers; the verified hits
  are copied into fresh blocks and committed into the tree, as if this engine had computed them,
  and freed. The allocate that follows then finds them cached like any device hit (so
  ``num_cached_tokens`` counts them), and the next request hits on the device.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

from kvcache import BlockManager, block_hashes
from kvcache.hashing import pack_tokens
from kvcache.radix_tree import Node
from kvcache.store import KVStore
from kvcache.tiers import BlockSpec, DiskTier, HostTier, Pending, RemoteTier, TieredStore
from runner.config import EngineConfig
from runner.kv_transfer import read_blocks, write_blocks

KEY_ENV = "KVCACHE_CACHE_KEY"
# The request id the block manager knows a load by: engine sequence ids are never negative.
_LOADING_ID = -1
WRITE_THROUGH = ("disk", "remote")


def cache_mac_key(config: EngineConfig) -> bytes | None:
    """The MAC key: EngineConfig.cache_key, else the environment's KVCACHE_CACHE_KEY. Raises
    ValueError when require_cache_mac is set and neither is."""
    key = config.cache_key if config.cache_key is not None else os.environ.get(KEY_ENV)
    if config.require_cache_mac and not key:
        raise ValueError(f"require_cache_mac needs cache_key= (or {KEY_ENV}) to be set")
    return key.encode() if key else None


def cache_identity_string(fingerprint: str, weights: str) -> str:
    """What a stored block's K/V depend on beyond its tokens: the weights and their rounding."""
    return f"{fingerprint}|weights={weights}"


class TierLoader:
    """Moves blocks between one engine's pool and its tiers."""

    def __init__(
        self, config: EngineConfig, bm: BlockManager, kv: KVStore, spec: BlockSpec
    ) -> None:
        tiers: list[Any] = []
        if config.host_cache_bytes:
            tiers.append(HostTier(config.host_cache_bytes))
        if config.disk_cache_dir:
            tiers.append(DiskTier(config.disk_cache_dir, config.disk_cache_bytes))
        if config.remote_cache_url:
            tiers.append(RemoteTier(config.remote_cache_url))
        self.store = TieredStore(spec, tiers, mac_key=cache_mac_key(config))
        self._close = weakref.finalize(self, self.store.close)  # queued writes land at exit
        self.bm, self.kv = bm, kv
        self.block_size = config.block_size
        self._loading = False  # blocks committed by a load came from the tiers: not written back
        self.loaded_blocks = 0
        self.load_seconds = 0.0
        bm.watch(self._committed, self._evicting if self.store.has("host") else None)

    # -- down ----------------------------------------------------------------------------------
    @staticmethod
    def _pending(node: Node, kv: bytes) -> Pending:
        parent = node.parent.key if node.parent is not None else node.namespace
        return Pending(node.key, parent, node.tokens, node.parent is None, kv)

    def _committed(self, nodes: list[Node]) -> None:
        if self._loading or not any(self.store.has(t) for t in WRITE_THROUGH):
            return
        if not self.store.room():  # dropped: copying them off the pool would be wasted
            self.store.dropped_writes += len(nodes)
            return
        payloads = read_blocks(self.kv, [n.block_id for n in nodes])
        self.store.write(
            WRITE_THROUGH, [self._pending(n, p) for n, p in zip(nodes, payloads, strict=True)]
        )

    def _evicting(self, node: Node) -> None:
        if not self.store.room():
            self.store.dropped_writes += 1
            return
        (payload,) = read_blocks(self.kv, [node.block_id])
        self.store.write(("host",), [self._pending(node, payload)])

    # -- up ------------------------------------------------------------------------------------
    def load(self, token_ids: Sequence[int], root: int) -> int:
        """Load the tiers' blocks that continue the device tree's longest match of this prompt
        into the pool (as cached blocks); returns how many. Loads fewer when the pool cannot
        spare the blocks (nothing held is ever evicted for it)."""
        B, bm = self.block_size, self.bm
        max_blocks = (len(token_ids) - 1) // B  # as BlockCache.match: one token is computed
        on_device = -(-len(token_ids) // B) - bm.blocks_needed(token_ids, root)
        if on_device >= max_blocks:
            return 0
        started = time.perf_counter()
        hashes = block_hashes(token_ids[: max_blocks * B], B, root)
        packed = pack_tokens(token_ids[: max_blocks * B])
        width = len(packed) // max_blocks
        blocks = [packed[i * width : (i + 1) * width] for i in range(on_device, max_blocks)]
        parent = hashes[on_device - 1] if on_device else root
        hits = self.store.lookup(hashes[on_device:], parent, blocks)
        n = len(hits)
        while n and not bm.can_allocate(self._probe(token_ids, on_device + n), root):
            n -= 1  # the pool cannot spare that many now
        if n:
            probe = self._probe(token_ids, on_device + n)
            alloc = bm.allocate(_LOADING_ID, probe, root, count=False)
            try:
                fresh = alloc.block_table[on_device : on_device + n]
                write_blocks(self.kv, fresh, [hit.value.kv for hit in hits[:n]])
                self._loading = True
                bm.commit(_LOADING_ID, probe, (on_device + n) * B)
            finally:
                self._loading = False
                bm.free(_LOADING_ID)
        self.loaded_blocks += n
        self.load_seconds += time.perf_counter() - started
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
        out["loaded_blocks"] = self.loaded_blocks
        out["load_ms_per_block"] = (
            1000 * self.load_seconds / self.loaded_blocks if self.loaded_blocks else 0.0
        )
        return out

    def flush(self) -> None:
        """Wait for every queued write (tests; a process about to hand its tiers to another)."""
        self.store.flush()

    def close(self) -> None:
        """Finish queued writes and close the tiers."""
        self._close()
