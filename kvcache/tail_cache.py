"""Partial last blocks ("tails") kept after their request ends, to be copied, never shared.

The radix tree caches full blocks only, so a prompt that goes on past its cached blocks would
compute its partial block from scratch: up to ``block_size - 1`` tokens, at every beam search
step and for every repeated prompt. A finished request's tail (its last partial
block, whose first ``r`` slots hold computed K/V) is therefore kept under the tree node it
follows. A later prompt that shares those tokens has their slots copied into its own fresh
block, since it writes the slots after them. Being copied and never held, a tail always has
ref 0. It is evictable at any time (the LRU holds every tail) and goes when its parent node is
evicted.

Invariants (checked by ``check_integrity``):
* a tail holds 1 .. block_size - 1 tokens and hangs under a live node of its namespace, or
  under the namespace's top when its request had no full block;
* under one parent, no tail's tokens start with another's: ``add`` keeps only the longer one.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import NamedTuple

from kvcache.hashing import TOKEN_BYTES
from kvcache.radix_tree import Node, RadixTree

# The most tails kept under one parent (the newest), and the most full blocks below it that
# `longest` compares too (the newest inserted): a node below which thousands of answers ended (a
# shared system prompt) must not cost thousands of comparisons at every admission.
MAX_TAILS_PER_PARENT = 16
MAX_FULL_CANDIDATES = 16


class Tail(NamedTuple):
    block_id: int
    tokens: bytes  # packed int64 tokens whose K/V are in the block's first slots
    parent: Node | None  # the full block it follows; None => the namespace's top
    namespace: int


class TailMatch(NamedTuple):
    block_id: int  # the block to copy from
    num_tokens: int  # leading slots to copy


def common_tokens(a: bytes, b: bytes) -> int:
    """How many leading tokens two packed token strings share. Pure.

    A binary search over slice equality: a handful of C-level comparisons instead of a Python
    loop over tokens."""
    n = min(len(a), len(b)) // TOKEN_BYTES
    if a[: n * TOKEN_BYTES] == b[: n * TOKEN_BYTES]:
        return n
    lo, hi = 0, n  # a and b agree on lo tokens and differ within hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * TOKEN_BYTES] == b[: mid * TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


class TailCache:
    """Tails by the (namespace, parent block) they follow. Holds structure only: the manager
    keeps their blocks' pool state and LRU order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # (namespace, parent block id or None) -> its tails, oldest first.
        self._under: dict[tuple[int, int | None], list[Tail]] = {}
        self._by_block: dict[int, Tail] = {}
        self.version = 0  # bumped whenever a tail is added or removed

    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._by_block

    def tails(self) -> Iterable[Tail]:
        """Every tail, in no particular order. Pure."""
        return self._by_block.values()

    @staticmethod
    def _key(namespace: int, parent: Node | None) -> tuple[int, int | None]:
        return namespace, None if parent is None else parent.block_id

    def under(self, namespace: int, parent: Node | None) -> list[Tail]:
        """The tails that follow ``parent`` (a copy). Pure."""
        return list(self._under.get(self._key(namespace, parent), ()))

    def longest(
        self,
        namespace: int,
        parent: Node | None,
        wanted: bytes,
        children: dict[int, Node],
        others: list[tuple[int, bytes]],
    ) -> TailMatch | None:
        """The block whose leading slots hold the longest prefix of ``wanted`` (packed tokens
        that follow ``parent``): one of its tails, one of the newest MAX_FULL_CANDIDATES of
        ``children`` (the full blocks below it), or one of ``others`` ((block, packed tokens
        its first slots hold): running requests' partial blocks). None when none shares a
        token. Pure."""
        best: TailMatch | None = None
        sources: list[tuple[int, bytes]] = [
            (t.block_id, t.tokens) for t in self._under.get(self._key(namespace, parent), ())
        ]
        newest = islice(reversed(children.values()), MAX_FULL_CANDIDATES)
        sources += [(node.block_id, node.tokens) for node in newest]
        sources += others
        for block_id, tokens in sources:
            n = common_tokens(tokens, wanted)
            if n and (best is None or n > best.num_tokens):
                best = TailMatch(block_id, n)
        return best

    def add(self, tail: Tail) -> list[int]:
        """Keep ``tail`` unless a tail under the same parent already starts with its tokens.
        Mutates: tails that ``tail`` extends, and the oldest beyond MAX_TAILS_PER_PARENT, are
        removed. Returns the blocks no longer kept (``tail``'s own when it was not added); the
        caller returns them to the pool."""
        key = self._key(tail.namespace, tail.parent)
        siblings = self._under.setdefault(key, [])
        if any(t.tokens.startswith(tail.tokens) for t in siblings):
            return [tail.block_id]
        gone = [t for t in siblings if tail.tokens.startswith(t.tokens)]
        siblings[:] = [t for t in siblings if not tail.tokens.startswith(t.tokens)]
        siblings.append(tail)
        if len(siblings) > MAX_TAILS_PER_PARENT:
            gone.append(siblings.pop(0))
        for t in gone:
            del self._by_block[t.block_id]
        self._by_block[tail.block_id] = tail
        self.version += 1
        return [t.block_id for t in gone]

    def remove(self, block_id: int) -> Tail:
        """Forget the tail in ``block_id`` (eviction). Mutates."""
        tail = self._by_block.pop(block_id)
        key = self._key(tail.namespace, tail.parent)
        siblings = self._under[key]
        siblings.remove(tail)
        if not siblings:
            del self._under[key]
        self.version += 1
        return tail

    def check_integrity(self, tree: RadixTree) -> None:
        """Assert the invariants in the module docstring against ``tree``, whose nodes the
        tails follow. AssertionError names the broken one."""
        width = self.block_size * TOKEN_BYTES
        listed = 0
        for (namespace, parent_block), siblings in self._under.items():
            assert siblings, f"parent {parent_block}: an empty tail list is kept"
            for tail in siblings:
                listed += 1
                name = f"tail {tail.block_id}"
                assert self._by_block.get(tail.block_id) is tail, f"{name}: unlisted"
                assert 0 < len(tail.tokens) < width, f"{name}: not a partial block"
                assert tail.namespace == namespace, f"{name}: namespace differs"
                if tail.parent is None:
                    assert parent_block is None, f"{name}: listed under a node"
                else:
                    assert parent_block is not None, f"{name}: listed at the top"
                    assert tree.node_of(parent_block) is tail.parent, f"{name}: parent evicted"
                    assert tail.parent.namespace == namespace, f"{name}: parent's namespace"
                assert tree.node_of(tail.block_id) is None, f"{name} is also a tree node"
                for other in siblings:
                    assert other is tail or not other.tokens.startswith(tail.tokens), (
                        f"{name} is a prefix of tail {other.block_id}"
                    )
            assert len(siblings) <= MAX_TAILS_PER_PARENT, f"parent {parent_block}: too many tails"
        assert listed == len(self._by_block), "a tail is listed twice or not at all"
