"""Running requests' partial last blocks, as copy sources beside the cached tails.

A running request writes each slot once, in order: the first ``computed % block_size`` slots of
its partial block hold K/V that never change while it lives. A prompt admitted beside it that
shares those tokens (another sample of the same prompt, the same question asked twice in one
batch) may copy them as it would copy a finished request's tail. The copy is made at once, at
allocation, so the source cannot be freed or written in between.

Each offer is what the request's last ``commit`` said: its token list then (a list that only
grows, so its first ``computed`` tokens stay what they were) and how many were computed. A
commit runs for every request at every step, so an offer is only updated in place there;
its tokens are packed when an admission asks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.hashing import pack_tokens

# The most running requests below one block that `sources` offers: a bound on the comparisons
# an admission makes, like the tails' own.
MAX_LIVE_PER_PARENT = 16

Key = tuple[int, int | None]  # (namespace, the block the partial one follows; None at the top)


class Offer:
    """One running request's partial block and what its computed slots hold."""

    __slots__ = ("key", "block_id", "start", "tokens", "computed")

    def __init__(
        self, key: Key, block_id: int, start: int, tokens: Sequence[int], computed: int
    ) -> None:
        self.key = key
        self.block_id = block_id
        self.start = start  # the block's first token position
        self.tokens = tokens
        self.computed = computed  # start < computed < start + block_size


class LiveTails:
    """Each running request's offer, by the full block its partial block follows."""

    def __init__(self) -> None:
        self._by_request: dict[int, Offer] = {}
        self._under: dict[Key, dict[int, None]] = {}  # insertion-ordered sets of request ids

    def refresh(self, request_id: int, block_id: int, tokens: Sequence[int], computed: int) -> bool:
        """Update a request's offer in place when it still offers ``block_id`` (one block, one
        position in one request's table); False when it does not. Mutates."""
        old = self._by_request.get(request_id)
        if old is None or old.block_id != block_id:
            return False
        old.tokens, old.computed = tokens, computed
        return True

    def offer(
        self,
        request_id: int,
        key: Key,
        block_id: int,
        start: int,
        tokens: Sequence[int],
        computed: int,
    ) -> None:
        """Record a request's new offer (its partial block after a commit). Mutates."""
        self.withdraw(request_id)
        self._by_request[request_id] = Offer(key, block_id, start, tokens, computed)
        self._under.setdefault(key, {})[request_id] = None

    def withdraw(self, request_id: int) -> None:
        """Forget a request's offer (finished, preempted, or nothing to offer). Mutates."""
        old = self._by_request.pop(request_id, None)
        if old is None:
            return
        ids = self._under[old.key]
        del ids[request_id]
        if not ids:
            del self._under[old.key]

    def sources(self, key: Key) -> list[tuple[int, bytes]]:
        """(block, packed tokens whose K/V its first slots hold) of the newest running requests
        below ``key``. Pure."""
        ids = list(self._under.get(key, ()))[-MAX_LIVE_PER_PARENT:]
        offers = [self._by_request[rid] for rid in ids]
        return [(o.block_id, pack_tokens(o.tokens[o.start : o.computed])) for o in offers]

    def entries(self) -> dict[int, Offer]:
        """Every running request's offer, by request id (a copy, for integrity checks). Pure."""
        return dict(self._by_request)
