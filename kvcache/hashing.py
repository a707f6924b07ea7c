"""Chained block hashes: the identity of a full block of tokens *and* everything before it.

h_0 = namespace_root(model, salt)
h_i = xxh3_64(seed=HASH_SEED, data=le_u64(h_{i-1}) || le_i64(tokens of block i))
Because h_i folds in h_{i-1}, equal hashes mean (with high probability) an equal whole prefix,
which is what KV reuse needs: a token's K/V in layer > 0 depends on every token before it.
A 64-bit hash can still collide, so the radix tree compares tokens before trusting a hit.

Tokens are packed once per call as little-endian int64 (``array('q')``) so the per-block work is
one bytes slice and one C hash call, never a per-token Python loop.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

# Fixed seed for every hash of this package: bumping it invalidates every cached prefix at once.
HASH_SEED = 0x6B76_6361_6368_6531  # "kvcache1"
TOKEN_BYTES = 8  # each token id is packed as a little-endian int64

_U64 = struct.Struct("<Q")
_BIG_ENDIAN = sys.byteorder == "big"


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Pack token ids as little-endian int64 bytes (the form hashed and compared). Pure."""
    packed = array("q", tokens)
    if _BIG_ENDIAN:  # keep hashes identical across machines
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(packed: bytes) -> list[int]:
    """The token ids of ``pack_tokens``' bytes (its inverse). Pure."""
    tokens = array("q", packed)
    if _BIG_ENDIAN:
        tokens.byteswap()
    return tokens.tolist()


def hash_packed_block(parent_hash: int, block: bytes) -> int:
    """Hash one packed block under its parent's hash. Pure; the single place xxh3 is applied
    to a block, so every path (match, insert, ``block_hashes``) agrees bit for bit."""
    return xxh3_64_intdigest(_U64.pack(parent_hash) + block, seed=HASH_SEED)


def namespace_root(model_fingerprint: str, cache_salt: str | None = None) -> int:
    """The chain root for one model (and optional per-request salt). Pure.

    Different fingerprint or salt => different root => no block is ever shared across them.
    ``None`` and ``""`` salts are kept distinct by a marker byte.
    """
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    data = b"kvcache-namespace\x00" + model_fingerprint.encode() + b"\x00" + salt
    return xxh3_64_intdigest(data, seed=HASH_SEED)


def hash_block(parent_hash: int, tokens: Sequence[int]) -> int:
    """Hash of one block given its parent's hash (or the namespace root). Pure."""
    return hash_packed_block(parent_hash, pack_tokens(tokens))


def block_hashes(tokens: Sequence[int], block_size: int, root: int) -> list[int]:
    """Chained hashes of every *full* block of ``tokens``; a partial tail gets none. Pure."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full = len(tokens) // block_size
    data = pack_tokens(tokens[: num_full * block_size])
    width = block_size * TOKEN_BYTES
    hashes: list[int] = []
    parent = root
    for off in range(0, num_full * width, width):
        parent = hash_packed_block(parent, data[off : off + width])
        hashes.append(parent)
    return hashes
