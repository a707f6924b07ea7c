"""Radix tree over full blocks: one node per cached block, keyed by its chained hash.

Shape: each namespace root (see ``hashing.namespace_root``) owns a dict of top-level nodes; every
node owns a dict of children keyed by the child's chained hash. A path from the top is a token
prefix, one block per level. The tree only holds structure; ref counts and LRU order live in
``BlockPool`` and the eviction policy (kvcache/eviction/), driven by ``BlockCache``.

Trust rule: a hash hit counts only if the node's packed tokens equal the query block's AND the node
hangs under the parent the walk came from. A 64-bit collision therefore turns into a miss (or,
on insert, a stop), never into reuse of another prefix's KV.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from kvcache.hashing import TOKEN_BYTES, hash_packed_block, pack_tokens, unpack_tokens

# The most children `continuation` compares a partial block against (a node under which many
# prompts diverge, a shared system prompt's last block, may have thousands): past it, no guess.
CONTINUATION_SCAN = 256


class Node:
    """One cached full block. ``RadixTree`` mutates its structure."""

    __slots__ = ("key", "tokens", "block_id", "parent", "namespace", "children")

    def __init__(
        self, key: int, tokens: bytes, block_id: int, parent: Node | None, namespace: int
    ) -> None:
        self.key = key  # chained hash; this node's slot in its parent's children
        self.tokens = tokens  # packed int64 tokens of this block, compared on every hit
        self.block_id = block_id  # KV block that holds this block's K/V
        self.parent = parent  # None => top level of `namespace`
        self.namespace = namespace
        self.children: dict[int, Node] = {}

    @property
    def token_ids(self) -> list[int]:
        """The block's tokens unpacked (for tests and debugging). Pure."""
        return unpack_tokens(self.tokens)

    def __repr__(self) -> str:
        return f"Node(block={self.block_id}, key={self.key:#018x}, children={len(self.children)})"


class _Walk(NamedTuple):
    nodes: list[Node]  # matched nodes, in path order
    last_hash: int  # hash of the last matched block (the start hash when none matched)
    stop_key: int | None  # hash of the first unmatched block; None when every block matched
    collided: bool  # the stop was a hash hit whose tokens or parent differ


class InsertResult(NamedTuple):
    existing: list[Node]  # blocks already cached under the same parent with equal tokens
    created: list[Node]  # new nodes that now own the caller's blocks
    collided: bool  # stopped at a colliding hash: blocks after `existing` were not inserted


class RadixTree:
    """Nodes keyed by block hash. Mutated by ``insert`` and ``remove_leaf`` only."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._width = block_size * TOKEN_BYTES  # bytes per packed block
        self._tops: dict[int, dict[int, Node]] = {}  # namespace root -> top-level nodes
        self._by_block: dict[int, Node] = {}  # block id -> its node (a block is at most one node)
        # Bumped by every insert that adds nodes and every removal: a match result stays true
        # while it is unchanged, so callers may keep it.
        self.version = 0

    def __len__(self) -> int:
        return len(self._by_block)

    def node_of(self, block_id: int) -> Node | None:
        """The node owning ``block_id``, if the block is cached in the tree. Pure."""
        return self._by_block.get(block_id)

    def nodes(self) -> Iterator[Node]:
        """Every node, in no particular order. Pure."""
        return iter(self._by_block.values())

    def children(self, namespace: int, parent: Node | None) -> dict[int, Node]:
        """The nodes directly below ``parent`` (None: the namespace's top level). Pure: the
        caller must not mutate the dict."""
        return self._tops.get(namespace, {}) if parent is None else parent.children

    def walk(self) -> Iterator[Node]:
        """Every node, each after its parent (breadth first). Pure."""
        level = [node for tops in self._tops.values() for node in tops.values()]
        while level:
            yield from level
            level = [child for node in level for child in node.children.values()]

    def _walk(
        self,
        children: dict[int, Node],
        parent: Node | None,
        parent_hash: int,
        data: bytes,
        num_blocks: int,
    ) -> _Walk:
        """The one walk shared by match and insert: follow ``data`` (packed tokens, block after
        block) down from ``parent`` while each block's hash, tokens and parent agree. Pure."""
        width = self._width
        nodes: list[Node] = []
        h = parent_hash
        for off in range(0, num_blocks * width, width):
            block = data[off : off + width]
            key = hash_packed_block(h, block)
            node = children.get(key)
            if node is None or node.tokens != block or node.parent is not parent:
                return _Walk(nodes, h, key, node is not None)
            nodes.append(node)
            children = node.children
            parent = node
            h = key
        return _Walk(nodes, h, None, False)

    def match(self, namespace: int, data: bytes, max_blocks: int) -> list[Node]:
        """Longest cached path for packed ``data`` (at most ``max_blocks`` blocks). Pure: no
        ticks, no ref counts; the caller decides whether the match is used."""
        top = self._tops.get(namespace)
        if top is None or max_blocks <= 0:
            return []
        num_blocks = min(max_blocks, len(data) // self._width)
        return self._walk(top, None, namespace, data, num_blocks).nodes

    def continuation(
        self,
        namespace: int,
        after: Node | None,
        tail: Sequence[int],
        k: int,
        rank: Callable[[int], tuple[int, ...]],
    ) -> list[int]:
        """Up to ``k`` tokens that followed ``tail`` below ``after`` (None: the namespace's top)
        in some cached path: whatever an earlier request with the same prefix went on with.
        Where several did, the path whose blocks ``rank`` (by block id) puts highest wins (the
        eviction policy's rank: the last to be evicted). Pure."""
        children = self.children(namespace, after)
        h = namespace if after is None else after.key
        width = self._width
        packed = pack_tokens(tail)
        while len(packed) >= width:  # whole blocks of the tail: follow them down by hash
            h = hash_packed_block(h, packed[:width])
            node = children.get(h)
            if node is None or node.tokens != packed[:width]:
                return []
            children, packed = node.children, packed[width:]
        if len(children) > CONTINUATION_SCAN:  # a partial block has no hash: a scan, bounded
            return []
        out: list[int] = []
        fits = [n for n in children.values() if n.tokens.startswith(packed)]
        node = max(fits, key=lambda n: rank(n.block_id)) if fits else None
        skip = len(packed) // TOKEN_BYTES
        while node is not None and len(out) < k:
            out += node.token_ids[skip:]
            skip = 0
            node = max(node.children.values(), key=lambda n: rank(n.block_id), default=None)
        return out[:k]

    def insert(
        self,
        namespace: int,
        parent: Node | None,
        data: bytes,
        block_ids: Sequence[int],
        *,
        only_new: bool = False,
    ) -> InsertResult:
        """Insert ``len(block_ids)`` packed blocks of ``data`` below ``parent`` (None: top level).

        Mutates the tree: blocks already present (same parent, equal tokens) are returned as
        ``existing`` and their ``block_ids`` stay outside the tree; the first missing block and
        everything after it become new nodes owning ``block_ids``; with ``only_new``, nothing
        is inserted once the first block is present. On a collision nothing more is inserted.
        ``parent`` must be a live node (the caller holds it, so it cannot be evicted).
        """
        if parent is None:
            children = self._tops.setdefault(namespace, {})
            parent_hash = namespace
        else:
            children = parent.children
            parent_hash = parent.key
        walk = self._walk(children, parent, parent_hash, data, len(block_ids))
        if walk.collided or walk.stop_key is None or (only_new and walk.nodes):
            return InsertResult(walk.nodes, [], walk.collided)
        if walk.nodes:
            parent = walk.nodes[-1]
            children = parent.children
        width = self._width
        key = walk.stop_key
        h = walk.last_hash
        created: list[Node] = []
        self.version += 1
        for i in range(len(walk.nodes), len(block_ids)):
            block = data[i * width : (i + 1) * width]
            if created:  # the first key was already computed by the walk
                key = hash_packed_block(h, block)
            block_id = block_ids[i]
            if block_id in self._by_block:
                raise ValueError(f"block {block_id} is already a tree node")
            node = Node(key, block, block_id, parent, namespace)
            children[key] = node
            self._by_block[block_id] = node
            created.append(node)
            parent, children, h = node, node.children, key
        return InsertResult(walk.nodes, created, False)

    def remove_leaf(self, node: Node) -> None:
        """Detach a childless node (eviction). Mutates the tree; its block leaves ``node_of``."""
        if node.children:
            raise ValueError(f"{node!r} has children; eviction takes leaves only")
        siblings = self._tops[node.namespace] if node.parent is None else node.parent.children
        del siblings[node.key]
        del self._by_block[node.block_id]
        self.version += 1
        if node.parent is None and not siblings:
            del self._tops[node.namespace]  # forget namespaces with nothing cached

    def check_integrity(self) -> None:
        """Assert the tree's own invariants (raises AssertionError naming the broken one):

        1. every node's parent is itself a node of the tree (same object) and lists it as the
           child under its key; a top-level node is listed by its namespace;
        2. a child shares its parent's namespace, and every node holds exactly one packed block;
        3. ``node_of`` is a bijection onto the nodes reachable from the namespaces (no orphans).
        """
        reachable = 0
        stack = [node for top in self._tops.values() for node in top.values()]
        for namespace, top in self._tops.items():
            assert top, f"namespace {namespace:#x} is kept with no nodes"
            for key, node in top.items():
                assert node.parent is None and node.key == key, f"{node!r}: not top-level"
                assert node.namespace == namespace, f"{node!r}: listed under another namespace"
        while stack:
            node = stack.pop()
            reachable += 1
            assert self._by_block.get(node.block_id) is node, f"{node!r} missing from node_of"
            assert len(node.tokens) == self._width, f"{node!r} does not hold one full block"
            if node.parent is None:
                listed = self._tops.get(node.namespace, {}).get(node.key)
            else:
                parent = node.parent
                assert self._by_block.get(parent.block_id) is parent, f"{node!r}: parent evicted"
                assert parent.namespace == node.namespace, f"{node!r}: namespace differs"
                listed = parent.children.get(node.key)
            assert listed is node, f"{node!r} is not listed by its parent under its key"
            for key, child in node.children.items():
                assert child.parent is node and child.key == key, f"{child!r}: wrong parent/key"
                stack.append(child)
        assert reachable == len(self._by_block), "node_of holds nodes unreachable from any root"
