"""The block manager's invariants, asserted from outside its hot paths (tests, the soak)."""

from __future__ import annotations

from collections import Counter

from kvcache.block_cache import BlockCache
from kvcache.radix_tree import Node, RadixTree
from kvcache.request_blocks import RequestBlocks


def check_block_manager(
    cache: BlockCache,
    requests: dict[int, RequestBlocks],
    num_blocks: int,
) -> None:
    """Assert every invariant of a block manager's parts (AssertionError names the broken
    one). Beyond the parts' own checks (``BlockPool.check_integrity``,
    ``RadixTree.check_integrity``, ``PartialBlocks.check_integrity``: the tails and the
    running requests' offers):

    1. the pool flags a block as cached content iff it is a tree node or a tail (so free /
       cached / in use is a partition that agrees with the tree and the tails);
    2. ref(b) == number of live requests holding b (table or pin); no request holds a block
       twice; a block in two requests' tables is a tree node (only cached blocks are shared);
    3. the eviction policy's evictable set holds exactly the tree nodes with ref 0 and no
       children, and every tail (which PartialBlocks.check_integrity checks has ref 0: copied,
       never held); the policy's own order is its ``check_integrity``'s;
    4. ref(parent) >= ref(child) for every node (holders of a node hold its parent);
    5. each request's chain is a parent-linked path from its namespace's top level, every
       chain node is held by the request (its table block at that index, or a pin), pins are
       chain nodes, and the chain is no longer than the table.

    What a caching policy promises beyond these (none: the tree and the tails stay empty) its
    own ``check_integrity`` asserts (kvcache/cache_policy.py).
    """
    pool, tree, tails = cache.pool, cache.tree, cache.partials
    pool.check_integrity()
    cache.eviction.check_integrity()
    tree.check_integrity()
    tails.check_integrity(tree, requests)
    for block in range(num_blocks):
        content = tree.node_of(block) is not None or block in tails
        assert pool.is_cached_node(block) == content, f"block {block}: flag differs"
    holders: Counter[int] = Counter()
    in_tables: Counter[int] = Counter()
    for rid, request in requests.items():
        held = request.table + request.pins
        assert len(set(held)) == len(held), f"request {rid} holds a block twice"
        holders.update(held)
        in_tables.update(request.table)
        _check_chain(tree, rid, request)
    for block in range(num_blocks):
        assert pool.ref(block) == holders[block], (
            f"block {block}: ref {pool.ref(block)} != {holders[block]} holders"
        )
        if in_tables[block] > 1:
            assert tree.node_of(block) is not None, f"private block {block} is shared"
    leaves = {n.block_id for n in tree.nodes() if pool.ref(n.block_id) == 0 and not n.children}
    leaves.update(tail.block_id for tail in tails.tails())
    assert set(cache.eviction.evictable_blocks()) == leaves, (
        "evictable set != tree nodes with ref 0 and no children, plus the tails"
    )
    for node in tree.nodes():
        if node.parent is not None:
            assert pool.ref(node.parent.block_id) >= pool.ref(node.block_id), (
                f"{node!r} is held more often than its parent"
            )


def _check_chain(tree: RadixTree, rid: int, request: RequestBlocks) -> None:
    assert len(request.chain) <= len(request.table), f"request {rid}: chain beyond table"
    pins = set(request.pins)
    parent: Node | None = None
    for i, node in enumerate(request.chain):
        assert tree.node_of(node.block_id) is node, f"request {rid}: chain node evicted"
        assert node.parent is parent, f"request {rid}: chain broken at block {i}"
        assert node.namespace == request.root, f"request {rid}: chain leaves its namespace"
        held = request.table[i] == node.block_id or node.block_id in pins
        assert held, f"request {rid}: chain block {i} is not held"
        parent = node
    assert pins <= {n.block_id for n in request.chain}, f"request {rid}: pin off chain"
