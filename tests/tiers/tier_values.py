"""Small block values for the tier tests: a spec of a few bytes a block, and chains of them."""

from __future__ import annotations

from kvcache.hashing import hash_packed_block, pack_tokens
from kvcache.tiers import BlockSpec, Link, encode, encode_chunk

SPEC = BlockSpec("model-a|weights=float32", "float32", 4, 1, 1, 2, 2 * 1 * 4 * 1 * 2 * 4)
ROOT = 0x1234_5678_9ABC_DEF0


def kv_bytes(seed: int) -> bytes:
    """A block's K/V bytes that differ by seed."""
    return bytes((seed * 31 + i) % 256 for i in range(SPEC.block_nbytes))


def chain(tokens: list[int], root: int = ROOT) -> list[tuple[int, int, bytes]]:
    """(hash, parent hash, packed tokens) of each full block of ``tokens``."""
    out = []
    parent = root
    B = SPEC.block_size
    for i in range(len(tokens) // B):
        packed = pack_tokens(tokens[i * B : (i + 1) * B])
        key = hash_packed_block(parent, packed)
        out.append((key, parent, packed))
        parent = key
    return out


def value_of(
    tokens: list[int], index: int, seed: int = 0, mac_key: bytes | None = None
) -> tuple[int, bytes]:
    """(hash, encoded value) of block ``index`` of ``tokens``' chain."""
    key, parent, packed = chain(tokens)[index]
    return key, encode(SPEC, key, parent, packed, kv_bytes(seed), top=index == 0, mac_key=mac_key)


def chunk_of(
    tokens: list[int], first: int, last: int, seed: int = 0, mac_key: bytes | None = None
) -> tuple[int, bytes]:
    """(hash of block ``last``, one value holding blocks ``first..last`` of ``tokens``' chain);
    block i's K/V are ``kv_bytes(seed + i)``."""
    links = [Link(*link) for link in chain(tokens)[first : last + 1]]
    kv = b"".join(kv_bytes(seed + i) for i in range(first, last + 1))
    return links[-1].key, encode_chunk(SPEC, links, kv, top=first == 0, mac_key=mac_key)
