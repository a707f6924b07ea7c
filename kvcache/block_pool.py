"""Fixed pool of KV block ids: reference counts and the free list.

Every block id is in exactly one state at any time:

* free:   ref 0, holds no cached KV; sits on the free list (never-cached or evicted blocks);
* cached: ref 0, holds the KV of a radix-tree node or of a tail (kvcache/partial_blocks.py);
  reclaimable by eviction;
* in use: ref > 0, held by at least one running request (tree node or private block).

The pool does not know the tree's shape nor the order of eviction. The block cache tells it
which blocks are cached content (``mark_cached`` / ``evict``); which cached blocks may be
evicted now, and which goes first, is the eviction policy's (kvcache/eviction/).
"""

from __future__ import annotations


class BlockPool:
    """Block ids ``0 .. num_blocks-1``. Each method's docstring says what it mutates."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._is_node = [False] * num_blocks  # block holds a tree node's KV
        # Popped from the end: block 0 is handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._num_cached = 0  # blocks with ref 0 that are tree nodes

    # -- counts (pure) -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - self._num_cached

    def ref(self, block: int) -> int:
        return self._ref[block]

    def is_cached_node(self, block: int) -> bool:
        """True when ``block`` holds a tree node's KV (whatever its ref count)."""
        return self._is_node[block]

    # -- ref counts ----------------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Pop ``n`` free blocks, each with ref 1. Mutates the free list. Raises ValueError,
        taking nothing, when fewer than ``n`` are free (the manager evicts first)."""
        free = self._free
        if n > len(free):
            raise ValueError(f"{n} blocks wanted, {len(free)} free (evict first)")
        if n <= 0:
            return []
        taken = free[-n:][::-1]  # popped from the end, one after the other
        del free[-n:]
        ref = self._ref
        for block in taken:
            ref[block] = 1
        return taken

    def acquire(self, block: int) -> None:
        """ref += 1 on a cached or in-use tree block. The caller must have taken it out of the
        evictable set first (``EvictionPolicy.held``): a referenced block is never evictable."""
        if not self._is_node[block]:
            raise ValueError(f"block {block} is not a tree node; only cached blocks are shared")
        if self._ref[block] == 0:
            self._num_cached -= 1
        self._ref[block] += 1

    def release(self, block: int) -> bool:
        """ref -= 1. At zero a tree block becomes cached; a private block goes back to the free
        list. Returns True when the ref count reached zero."""
        ref = self._ref[block] - 1
        if ref < 0:
            raise ValueError(f"block {block} released more often than held")
        self._ref[block] = ref
        if ref:
            return False
        if self._is_node[block]:
            self._num_cached += 1
        else:
            self._free.append(block)
        return True

    def mark_cached(self, block: int) -> None:
        """Record that an in-use block now backs a tree node (after insert). Mutates flags."""
        if self._ref[block] <= 0 or self._is_node[block]:
            raise ValueError(f"block {block} must be in use and not yet a tree node")
        self._is_node[block] = True

    def evict(self, block: int) -> None:
        """A cached block whose node left the tree: back to the free list. The caller took it
        out of the evictable set already. Mutates flags, counts and the free list."""
        if self._ref[block] or not self._is_node[block]:
            raise ValueError(f"block {block} is not an evictable cached block")
        self._is_node[block] = False
        self._num_cached -= 1
        self._free.append(block)

    def check_integrity(self) -> None:
        """Assert the pool's own invariants (raises AssertionError naming the broken one):

        1. the free list has no duplicates and holds exactly the blocks with ref 0 that are not
           tree nodes; no ref count is negative;
        2. ``num_cached`` equals the number of tree blocks with ref 0.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        cached = 0
        for block, (ref, is_node) in enumerate(zip(self._ref, self._is_node, strict=True)):
            assert ref >= 0, f"block {block} has negative ref {ref}"
            assert (block in free) == (ref == 0 and not is_node), (
                f"block {block}: on free list={block in free}, ref={ref}, tree node={is_node}"
            )
            cached += ref == 0 and is_node
        assert cached == self._num_cached, f"cached count {self._num_cached} != actual {cached}"
