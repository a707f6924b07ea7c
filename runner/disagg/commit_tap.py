"""A prefill worker's handover filled while its prefill runs: each block the engine commits
(after the forward that wrote its K/V, chunk by chunk in a chunked prefill) that an open
handover wants is copied off the pool at once and encoded as a block value on this tap's own
thread, into the held handover (held.py). A decode worker pulling meanwhile gets the first
blocks before the last are computed, and once the prefill ends only its last chunk's blocks
are left to encode and send.

The prompt's blocks the pool holds already when the handover opens (a prefix another request
computed) are read at the open, under the engine lock, so no commit falls between the two."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache.radix_tree import Node
from kvcache.tiers import encode
from runner.disagg.blocks import PromptChain, cached_values, prompt_chain
from runner.disagg.held import HeldHandovers
from runner.engine.kv_transfer import read_blocks


@dataclass
class _Open:
    token_ids: list[int]
    cache_salt: str | None
    chain: PromptChain
    index: dict[int, int]  # block hash -> its place in the chain
    pending: int = 0  # blocks copied off the pool, not yet encoded
    done: threading.Condition = field(default_factory=threading.Condition)


class CommitTap:
    """Feeds ``held``'s open handovers from ``llm``'s commits."""

    def __init__(self, llm: Any, held: HeldHandovers) -> None:
        self.llm, self.held = llm, held
        # Changed under both the engine lock (so an open falls between two commits) and this
        # one; read under either. finish takes only this one: waiting for the engine lock
        # would wait out another request's prefill step.
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[str, _Open, int, bytes] | None] = queue.SimpleQueue()
        self.encoded_blocks = 0
        bm = llm.block_manager
        # The block manager has one commit callback (the tiers' write-through may hold it):
        # chain to it rather than take its place.
        self._previous = bm._on_commit
        bm.watch(self._committed, bm._cache.on_evict)
        self._thread = threading.Thread(target=self._encode, name="kv-handover-tap", daemon=True)
        self._thread.start()

    def open(self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """Start filling ``handover_id`` with the prompt's blocks as they are committed (and
        with those the pool holds now)."""
        tokens = list(token_ids)
        chain = prompt_chain(self.llm, tokens, cache_salt)
        entry = _Open(tokens, cache_salt, chain, {h: i for i, h in enumerate(chain.hashes)})
        self.held.open(handover_id)
        with self.llm.lock:
            with self._lock:
                self._open[handover_id] = entry
            # The block manager's own lookup (pure), capped as admission is.
            cached = self.llm.block_manager._match(tokens, chain.root)[: len(chain.hashes)]
            self._enqueue(handover_id, entry, cached)

    def finish(self, handover_id: str) -> None:
        """The prefill ended: wait until every block it committed is encoded, add what the
        commits missed (read off the pool, as a handover held whole is), and close the
        handover."""
        with self._lock:
            entry = self._open.pop(handover_id, None)
        if entry is None:
            return
        with entry.done:
            entry.done.wait_for(lambda: entry.pending == 0)
        wanted = entry.chain.hashes
        have = self.held.get(handover_id, wanted)
        if any(v is None for v in have):
            for i, value in enumerate(cached_values(self.llm, entry.token_ids, entry.cache_salt)):
                if have[i] is None:
                    self.held.add(handover_id, wanted[i], value)
        self.held.finish(handover_id)

    def cancel(self, handover_id: str) -> None:
        """Stop filling a handover (its request failed or was released); the values it holds
        stay until released."""
        with self._lock:
            self._open.pop(handover_id, None)

    # -- the engine's side (under its lock, inside a step) -------------------------------------
    def _committed(self, nodes: list[Node]) -> None:
        if self._previous is not None:
            self._previous(nodes)
        with self._lock:
            open_now = list(self._open.items())
        for handover_id, entry in open_now:
            wanted = [n for n in nodes if n.key in entry.index]
            if wanted:
                self._enqueue(handover_id, entry, wanted)

    def _enqueue(self, handover_id: str, entry: _Open, nodes: list[Node]) -> None:
        payloads = read_blocks(self.llm.kv, [n.block_id for n in nodes])
        with entry.done:
            entry.pending += len(nodes)
        for node, kv in zip(nodes, payloads, strict=True):
            self._queue.put((handover_id, entry, entry.index[node.key], kv))

    # -- the tap's thread ----------------------------------------------------------------------
    def _encode(self) -> None:
        llm = self.llm
        while (item := self._queue.get()) is not None:
            handover_id, entry, at, kv = item
            chain = entry.chain
            parent = chain.hashes[at - 1] if at else chain.root
            try:
                value = encode(
                    llm.block_spec, chain.hashes[at], parent, chain.tokens[at], kv,
                    top=at == 0, mac_key=llm.cache_mac_key,
                )  # fmt: skip
                self.held.add(handover_id, chain.hashes[at], value)
                self.encoded_blocks += 1
            finally:
                with entry.done:
                    entry.pending -= 1
                    entry.done.notify_all()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
