"""A prefill worker's handover filled while its prefill runs: each block the engine commits
(after the forward that wrote its K/V, chunk by chunk in a chunked prefill) that an open
handover wants is copied off the pool and encoded as a block value in that step, into the held
handover (held.py): the tap is one of the engine's block listeners (runner/engine/api/interface.py),
beside the KV events and any other. A decode worker pulling meanwhile gets the first blocks
before the last are computed, and once the prefill ends only its last chunk's blocks are left
to send.

The prompt's blocks the pool holds already when the handover opens (a prefix another request
computed) are read at the open, under the engine lock, so no commit falls between the two."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache.radix_tree import Node
from runner.disagg.blocks import PromptChain, prompt_chain
from runner.disagg.held import HeldHandovers
from runner.engine.api.interface import EngineInterface


@dataclass
class _Open:
    token_ids: list[int]
    cache_salt: str | None
    chain: PromptChain
    index: dict[int, int]  # block hash -> its place in the chain


class CommitTap:
    """Feeds ``held``'s open handovers from ``llm``'s commits (a block listener on it, from
    construction until ``close``)."""

    def __init__(
        self,
        llm: EngineInterface,
        held: HeldHandovers,
        on_held: Callable[[str, int, bytes], None] | None = None,
    ) -> None:
        # ``on_held``: told of each value held (the Redis transport writes it on: redis_stream.py)
        self.llm, self.held, self.on_held = llm, held, on_held
        # Changed under both the engine lock (so an open falls between two commits) and this
        # one; read under either. finish takes only this one: waiting for the engine lock
        # would wait out another request's prefill step.
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self.encoded_blocks = 0
        self._listening = True
        llm.add_block_listener(self)

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
            cached = self.llm.cached_block_values(tokens, cache_salt)  # pure, in chain order
            for block_hash, value in zip(chain.hashes, cached, strict=False):
                self._hold(handover_id, block_hash, value)
                self.encoded_blocks += 1

    def is_filling(self, handover_id: str) -> bool:
        """Whether the handover was opened here and is not finished or cancelled yet."""
        with self._lock:
            return handover_id in self._open

    def finish(self, handover_id: str) -> None:
        """The prefill ended: add what the commits missed (read off the pool, as a handover
        held whole is), and close the handover."""
        with self._lock:
            entry = self._open.pop(handover_id, None)
        if entry is None or not self.held.holds(handover_id):
            # Not held: its decode worker pulled every block as the last step committed it
            # and released it (or it was dropped): nothing to add, and no reason to wait for
            # the engine lock, which the next prompt's step may hold a second. (Held, with no
            # entry here: its open failed half-way; closed, so that its deadline runs.)
            self.held.finish(handover_id)
            return
        wanted = entry.chain.hashes
        have = self.held.get(handover_id, wanted)
        if any(v is None for v in have):
            cached = self.llm.cached_block_values(entry.token_ids, entry.cache_salt)
            for i, value in enumerate(cached):
                if have[i] is None:
                    self._hold(handover_id, wanted[i], value)
        self.held.finish(handover_id)

    def cancel(self, handover_id: str) -> None:
        """Stop filling a handover (its request failed or was released); the values it holds
        stay until released."""
        with self._lock:
            self._open.pop(handover_id, None)

    # -- the engine's side: a block listener (under its lock, inside a step) --------------------
    def blocks_stored(self, nodes: list[Node]) -> None:
        with self._lock:
            open_now = list(self._open.items())
        for handover_id, entry in open_now:
            wanted = [n for n in nodes if n.key in entry.index]
            if wanted:
                self._add(handover_id, wanted)

    def blocks_removed(self, nodes: list[Node]) -> None:
        """Nothing to do: a handover holds its own copies of the values."""

    def _add(self, handover_id: str, nodes: list[Node]) -> None:
        """Encode the nodes' blocks into the handover, here, in the step that committed them.
        Not on a thread of its own: the forward holds the interpreter for most of a step, so
        such a thread fell whole chunks behind, and the end of the prefill waited for it. A
        block takes a copy and a checksum, a small part of a step that computes it."""
        for node, value in zip(nodes, self.llm.block_values(nodes), strict=True):
            self._hold(handover_id, node.key, value)
            self.encoded_blocks += 1

    def _hold(self, handover_id: str, block_hash: int, value: bytes) -> None:
        if self.held.add(handover_id, block_hash, value) and self.on_held is not None:
            self.on_held(handover_id, block_hash, value)

    def close(self) -> None:
        """Stop listening to the engine's commits (nothing runs of its own)."""
        if self._listening:
            self._listening = False
            self.llm.remove_block_listener(self)
