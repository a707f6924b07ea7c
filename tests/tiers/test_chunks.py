"""Chunked values: a value holding consecutive blocks of a chain, keyed by its last block. The
lookup over chunks and single blocks in any tier, laid out as the writer cuts a chain (chunks
of C blocks aligned on the chain, single blocks), equals a simple reference (the longest
prefix of the chain that intact values cover, from any place in the chain on, a block's chunk
tried before its own value), each block served with its own K/V, and reads no value it does
not serve or reject (nothing past the first gap); a chunk with one wrong block, a flipped byte
or a wrong MAC is never served."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tier_values import ROOT, SPEC, chain, chunk_of, kv_bytes

from kvcache.hashing import hash_packed_block, pack_tokens
from kvcache.tiers import DiskTier, HostTier, Link, Miss, TieredStore, decode_chunk, encode_chunk

TOKENS = list(range(200, 248))  # twelve blocks of four
LINKS = chain(TOKENS)
C = 4  # blocks a chunk: chunk i is blocks 4i..4i+3, keyed by block 4i+3


def lookup(store: TieredStore, start: int = 0) -> list[tuple[str, int, bytes]]:
    """(tier, hash, K/V) of each block found from block ``start`` of the chain on."""
    parent = LINKS[start - 1][0] if start else ROOT
    rest = LINKS[start:]
    hits = store.lookup([h for h, _, _ in rest], parent, [t for _, _, t in rest], start)
    return [(hit.tier, hit.value.key, bytes(hit.value.kv)) for hit in hits]


def reference(stored: dict[int, tuple[int, bool]], start: int) -> tuple[int, int, int]:
    """(blocks from ``start`` on that the values cover without a gap, values served, values
    rejected), ``stored``: the value under each block's key, (its first block, damaged?).
    At each block its chunk's value is tried first, then its own."""
    pos, served, rejected, tried = start, 0, 0, set()
    while pos < len(LINKS):
        for last in dict.fromkeys(((pos // C + 1) * C - 1, pos)):
            if last in stored and last not in tried and stored[last][0] <= pos:
                tried.add(last)
                if not stored[last][1]:
                    served, pos = served + 1, last + 1
                    break
                rejected += 1
        else:
            break
    return pos - start, served, rejected


# A stored value: a chunk (its index) or a single block (a place that is not a chunk's last:
# there the writer writes the chunk), and whether it is damaged.
CHUNKS = st.tuples(st.just("chunk"), st.integers(0, 2), st.booleans())
SINGLES = st.tuples(
    st.just("single"), st.integers(0, 11).filter(lambda i: (i + 1) % C), st.booleans()
)
VALUES = st.lists(st.one_of(CHUNKS, SINGLES), min_size=0, max_size=10)


@settings(max_examples=80, deadline=None)
@given(values=VALUES, start=st.integers(0, 11), split=st.booleans())
def test_lookup_over_chunks_equals_the_reference(
    values: list[tuple[str, int, bool]], start: int, split: bool
) -> None:
    host, lower = HostTier(10**6), HostTier(10**6)
    lower.name = "disk"  # type: ignore[misc]  # a second in-memory tier below the first
    store = TieredStore(SPEC, [host, lower], chunk_blocks=C, warn=lambda message: None)
    stored: dict[int, tuple[int, bool]] = {}  # last block -> (first block, damaged)
    for i, (kind, index, damaged) in enumerate(values):
        first, last = (C * index, C * index + C - 1) if kind == "chunk" else (index, index)
        key, data = chunk_of(TOKENS, first, last)
        if damaged:
            data = data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]
        tier = lower if split and i % 2 else host
        name = store.key_of(key)
        for other in (host, lower):  # one value a key: the last one put, in one tier
            other.discard(name)
        tier.put(name, data)
        stored[last] = (first, damaged)
    got = lookup(store, start)
    blocks, served, rejected = reference(stored, start)
    assert len(got) == blocks
    for i, (_, key, kv) in enumerate(got):  # each block its own hash and K/V
        assert key == LINKS[start + i][0] and kv == kv_bytes(start + i)
    counters = store.counters.values()
    assert sum(c.rejected_blocks for c in counters) == rejected
    # Nothing past the chain's first gap is read: without damage, every value read is served
    # (one round reads every value up to the gap; a rejected one ends the run by its last
    # block at the latest, so the values read past it are not served).
    fetched = sum(c.fetched_values for c in counters)
    assert fetched == served if not rejected else served + rejected <= fetched <= len(stored)
    store.close()


def test_a_chunk_serves_the_blocks_past_the_device(tmp_path: Path) -> None:
    """The device holds blocks 0..5; the chunk of blocks 4..7 gives 6 and 7, a single gives 8."""
    disk = DiskTier(tmp_path, 10**6)
    store = TieredStore(SPEC, [disk], chunk_blocks=C)
    for first, last in ((4, 7), (8, 8)):
        key, data = chunk_of(TOKENS, first, last)
        disk.put(store.key_of(key), data)
    assert [h for _, h, _ in lookup(store, 6)] == [LINKS[i][0] for i in (6, 7, 8)]
    assert store.counters["disk"].hit_blocks == 3
    store.close()


def test_a_chunk_with_one_wrong_block_is_a_miss() -> None:
    """Block 2 of a chunk relabelled (its own hash recomputed, so the value is consistent):
    the chain's block 2 is another one, and no block of that chunk is served."""
    links = [Link(*link) for link in LINKS[:4]]
    other = pack_tokens([1, 2, 3, 4])
    k2 = hash_packed_block(links[1].key, other)
    k3 = hash_packed_block(k2, links[3].tokens)
    crafted = [links[0], links[1], Link(k2, links[1].key, other), Link(k3, k2, links[3].tokens)]
    kv = b"".join(kv_bytes(i) for i in range(4))
    host = HostTier(10**6)
    store = TieredStore(SPEC, [host], chunk_blocks=C, warn=lambda message: None)
    # Stored under the real block 3's key, as a poisoned or colliding store might.
    host.put(store.key_of(LINKS[3][0]), encode_chunk(SPEC, crafted, kv, top=True))
    assert lookup(store) == []
    assert store.counters["host"].rejected_blocks == 1
    store.close()


def test_chunk_values_check_their_links_and_mac() -> None:
    _, data = chunk_of(TOKENS, 0, 3, mac_key=b"k")
    blocks = decode_chunk(data, SPEC, mac_key=b"k")
    assert not isinstance(blocks, Miss) and [b.key for b in blocks] == [h for h, _, _ in LINKS[:4]]
    assert blocks[0].top and not blocks[1].top
    assert decode_chunk(data, SPEC, mac_key=b"other") == Miss("MAC mismatch")
    unchained = [Link(*LINKS[0]), Link(*LINKS[2])]
    with pytest.raises(ValueError, match="follow each other"):
        encode_chunk(SPEC, unchained, kv_bytes(0) * 2, top=True)
    with pytest.raises(ValueError, match="K/V"):
        encode_chunk(SPEC, [Link(*LINKS[0]), Link(*LINKS[1])], kv_bytes(0), top=True)
