"""Radix tree: longest-prefix match, insert of new blocks, collisions become misses."""

from __future__ import annotations

import pytest

import kvcache.hashing
from kvcache.hashing import namespace_root, pack_tokens
from kvcache.radix_tree import RadixTree

B = 4
ROOT = namespace_root("m")


def blocks(*rows: list[int]) -> bytes:
    """Pack whole blocks (each row is one block of B tokens)."""
    for row in rows:
        assert len(row) == B
    return pack_tokens([t for row in rows for t in row])


@pytest.fixture
def constant_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block hashes to the same value: every lookup is a hash hit."""
    monkeypatch.setattr(kvcache.hashing, "xxh3_64_intdigest", lambda data, seed=0: 42)


def test_insert_then_match_longest_prefix() -> None:
    tree = RadixTree(B)
    a, b, c = [1] * B, [2] * B, [3] * B
    result = tree.insert(ROOT, None, blocks(a, b), [10, 11])
    assert [n.block_id for n in result.created] == [10, 11] and not result.existing
    assert [n.block_id for n in tree.match(ROOT, blocks(a, b, c), 3)] == [10, 11]
    assert [n.block_id for n in tree.match(ROOT, blocks(a, c), 2)] == [10]
    assert tree.match(ROOT, blocks(b, a), 2) == []
    tree.check_integrity()


def test_match_respects_max_blocks() -> None:
    tree = RadixTree(B)
    tree.insert(ROOT, None, blocks([1] * B, [2] * B), [0, 1])
    assert len(tree.match(ROOT, blocks([1] * B, [2] * B), 1)) == 1
    assert tree.match(ROOT, blocks([1] * B, [2] * B), 0) == []


def test_insert_below_parent_and_report_existing_blocks() -> None:
    tree = RadixTree(B)
    first = tree.insert(ROOT, None, blocks([1] * B), [0]).created[0]
    second = tree.insert(ROOT, first, blocks([2] * B), [1]).created[0]
    assert second.parent is first
    # Same content computed again elsewhere (blocks 5, 6): both already cached, nothing created.
    again = tree.insert(ROOT, None, blocks([1] * B, [2] * B, [3] * B), [5, 6, 7])
    assert again.existing == [first, second]
    assert [n.block_id for n in again.created] == [7]
    assert tree.node_of(5) is None and tree.node_of(6) is None
    assert again.created[0].token_ids == [3] * B
    tree.check_integrity()


def test_same_block_under_different_parents_are_different_nodes() -> None:
    tree = RadixTree(B)
    tree.insert(ROOT, None, blocks([1] * B, [9] * B), [0, 1])
    tree.insert(ROOT, None, blocks([2] * B, [9] * B), [2, 3])
    assert len(tree) == 4
    assert [n.block_id for n in tree.match(ROOT, blocks([2] * B, [9] * B), 2)] == [2, 3]


def test_namespaces_never_share() -> None:
    tree = RadixTree(B)
    tree.insert(ROOT, None, blocks([1] * B), [0])
    assert tree.match(namespace_root("m", "salt"), blocks([1] * B), 1) == []
    assert tree.match(namespace_root("other"), blocks([1] * B), 1) == []


@pytest.mark.usefixtures("constant_hash")
def test_collision_is_a_miss_never_a_wrong_reuse() -> None:
    tree = RadixTree(B)
    tree.insert(ROOT, None, blocks([1] * B, [2] * B), [0, 1])
    assert tree.match(ROOT, blocks([7] * B), 1) == []  # same hash, other tokens
    assert [n.block_id for n in tree.match(ROOT, blocks([1] * B, [5] * B), 2)] == [0]
    assert [n.block_id for n in tree.match(ROOT, blocks([1] * B, [2] * B), 2)] == [0, 1]


@pytest.mark.usefixtures("constant_hash")
def test_insert_stops_at_a_collision() -> None:
    tree = RadixTree(B)
    tree.insert(ROOT, None, blocks([1] * B), [0])
    result = tree.insert(ROOT, None, blocks([7] * B, [8] * B), [3, 4])
    assert result.collided and not result.created and not result.existing
    assert tree.node_of(3) is None and len(tree) == 1
    tree.check_integrity()


def test_remove_leaf_only_and_forget_empty_namespace() -> None:
    tree = RadixTree(B)
    a, b = tree.insert(ROOT, None, blocks([1] * B, [2] * B), [0, 1]).created
    with pytest.raises(ValueError):
        tree.remove_leaf(a)
    tree.remove_leaf(b)
    assert tree.match(ROOT, blocks([1] * B, [2] * B), 2) == [a]
    tree.remove_leaf(a)
    assert len(tree) == 0 and tree.match(ROOT, blocks([1] * B), 1) == []
    tree.check_integrity()


def test_block_cannot_back_two_nodes() -> None:
    tree = RadixTree(B)
    tree.insert(ROOT, None, blocks([1] * B), [0])
    with pytest.raises(ValueError):
        tree.insert(ROOT, None, blocks([2] * B), [0])


def test_check_integrity_catches_a_broken_parent_link() -> None:
    tree = RadixTree(B)
    a, b = tree.insert(ROOT, None, blocks([1] * B, [2] * B), [0, 1]).created
    tree.check_integrity()
    del a.children[b.key]  # b now claims a parent that does not list it
    with pytest.raises(AssertionError, match="not listed|unreachable"):
        tree.check_integrity()
