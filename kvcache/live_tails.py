"""Running requests' partial last blocks, as copy sources beside the cached tails.

A running request writes each slot once, in order: the first ``computed % block_size`` slots of
its partial block hold K/V that never change while it lives. A prompt admitted beside it that
shares those tokens (another sample of the same prompt, the same question asked twice in one
batch) may copy them as it would copy a finished request's tail. The copy is made at once, at
allocation, so the source cannot be freed or written in between. Each entry is what the
request's last ``commit`` said its partial block held.
"""

from __future__ import annotations

from kvcache.tail_cache import Tail

# The most running requests below one block that `sources` offers: a bound on the comparisons
# an admission makes, like the tails' own.
MAX_LIVE_PER_PARENT = 16

Key = tuple[int, int | None]  # (namespace, the block the partial one follows; None at the top)


def _key(tail: Tail) -> Key:
    return tail.namespace, None if tail.parent is None else tail.parent.block_id


class LiveTails:
    """Each running request's partial block (as a Tail it does not yet own) by the full block
    it follows."""

    def __init__(self) -> None:
        self._by_request: dict[int, Tail] = {}
        self._under: dict[Key, dict[int, None]] = {}  # insertion-ordered sets of request ids

    def update(self, request_id: int, tail: Tail | None) -> None:
        """Record what a request's partial block holds after a commit; None: nothing to offer
        (no computed slot in it, or its chain does not reach it). Mutates."""
        old = self._by_request.get(request_id)
        if old is not None and (tail is None or _key(old) != _key(tail)):
            self.remove(request_id)
            old = None
        if tail is None:
            return
        if old is None:
            self._under.setdefault(_key(tail), {})[request_id] = None
        self._by_request[request_id] = tail

    def remove(self, request_id: int) -> None:
        """Forget a request (finished or preempted). Mutates."""
        tail = self._by_request.pop(request_id, None)
        if tail is None:
            return
        ids = self._under[_key(tail)]
        del ids[request_id]
        if not ids:
            del self._under[_key(tail)]

    def sources(self, key: Key) -> list[tuple[int, bytes]]:
        """(block, packed tokens whose K/V its first slots hold) of the newest running requests
        below ``key``. Pure."""
        ids = list(self._under.get(key, ()))[-MAX_LIVE_PER_PARENT:]
        return [(self._by_request[rid].block_id, self._by_request[rid].tokens) for rid in ids]

    def entries(self) -> dict[int, Tail]:
        """Every running request's entry, by request id (a copy, for integrity checks). Pure."""
        return dict(self._by_request)
