"""The one format of KV stored outside the device pool (a tier, a cache file, a handover): a
value holds one block or a chunk of consecutive blocks of one chain.

A value is a small fixed header, one link (hash, parent hash, token count) per block, the
blocks' tokens and their raw K/V bytes, then an xxh3 checksum of everything before it and,
when a key is configured, an HMAC-SHA256 of everything before that. No pickle, no torch:
bytes in, bytes out. Layout (little-endian):

    magic b"KVCB" | version u16 | flags u16 | block_size u32 | num_blocks u32
    | num_layers u32 | num_kv_heads u32 | head_dim u32 | kv_nbytes u64
    | identity_len u16 | dtype_len u16 | identity | dtype
    | links (num_blocks x [key u64 | parent u64 | num_tokens u32])
    | tokens (every block's, int64) | K/V (kv_nbytes: num_blocks x [layers, 2, block_size,
      heads, head_dim])
    | checksum u64 (xxh3_64 of all of the above)
    | mac (32 bytes, HMAC-SHA256 of all of the above; only when flags has FLAG_MAC)

A block's ``key`` is its chained hash (``hashing.hash_packed_block(parent, tokens)``), so a
value names its own place in the chain; decoding recomputes every one and checks that each
block's parent is the block before it. Only the last block may hold fewer tokens than a block
(a tail). Without a MAC key the checksum catches damage, not forgery: a value is then trusted
input, like a model file.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple

from xxhash import xxh3_64_intdigest

from kvcache.hashing import TOKEN_BYTES, hash_packed_block

MAGIC = b"KVCB"
VERSION = 2  # 2: a value holds a chunk of blocks (1 held exactly one)
FLAG_TOP = 1  # the first block's parent hash is a namespace root (no block above it)
FLAG_MAC = 2  # a MAC follows the checksum
_HEADER = struct.Struct("<4sHHIIIIIQHH")
_LINK = struct.Struct("<QQI")
_SUM = struct.Struct("<Q")
MAC_BYTES = 32


class BlockSpec(NamedTuple):
    """What a value must agree with to be used by an engine."""

    identity: str  # the model's fingerprint and anything else its K/V depend on (weights)
    dtype: str  # the K/V elements' dtype, as torch names it ("float32")
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_nbytes: int  # bytes of one block's K/V (2 * layers * block_size * heads * dim * item)


class BlockValue(NamedTuple):
    """One decoded block that passed every check."""

    key: int  # chained hash of this block
    parent: int  # the parent block's hash, or the namespace root when ``top``
    tokens: bytes  # packed int64 tokens (num_tokens of them; fewer than a block for a tail)
    top: bool
    kv: memoryview  # the K/V bytes (a view into the encoded value)


class Link(NamedTuple):
    """A block's place in its chain, as a writer gives it."""

    key: int
    parent: int
    tokens: bytes  # packed int64 tokens


class Miss(NamedTuple):
    """Why a value was not used."""

    reason: str


def encode_chunk(
    spec: BlockSpec,
    links: Sequence[Link],
    kv: bytes | memoryview,
    *,
    top: bool,
    mac_key: bytes | None = None,
) -> bytes:
    """One value holding ``links``' blocks (consecutive in one chain) and their K/V, block
    after block. Pure. Raises ValueError when the parts do not fit ``spec``: a writer never
    stores what no reader could use."""
    if not links:
        raise ValueError("a value holds at least one block")
    B = spec.block_size
    for i, link in enumerate(links):
        n = len(link.tokens) // TOKEN_BYTES
        full = i < len(links) - 1
        if len(link.tokens) % TOKEN_BYTES or not (n == B if full else 1 <= n <= B):
            raise ValueError(f"a block holds 1..{B} tokens, got {len(link.tokens)} bytes")
        if i and link.parent != links[i - 1].key:
            raise ValueError("the blocks of a value must follow each other in one chain")
    if len(kv) != spec.block_nbytes * len(links):
        raise ValueError(f"{len(links)} blocks' K/V is {spec.block_nbytes * len(links)} bytes")
    ident, dtype = spec.identity.encode(), spec.dtype.encode()
    flags = (FLAG_TOP if top else 0) | (FLAG_MAC if mac_key else 0)
    head = _HEADER.pack(
        MAGIC, VERSION, flags, B, len(links), spec.num_layers, spec.num_kv_heads,
        spec.head_dim, len(kv), len(ident), len(dtype),
    )  # fmt: skip
    refs = [_LINK.pack(k.key, k.parent, len(k.tokens) // TOKEN_BYTES) for k in links]
    body = b"".join((head, ident, dtype, *refs, *(k.tokens for k in links), kv))
    checksum = _SUM.pack(xxh3_64_intdigest(body))
    if not mac_key:
        return body + checksum
    mac = hmac.new(mac_key, body, hashlib.sha256)
    mac.update(checksum)
    return body + checksum + mac.digest()


def encode(
    spec: BlockSpec,
    key: int,
    parent: int,
    tokens: bytes,
    kv: bytes | memoryview,
    *,
    top: bool,
    mac_key: bytes | None = None,
) -> bytes:
    """A value of one block (``encode_chunk`` of one link). Pure; raises ValueError."""
    return encode_chunk(spec, [Link(key, parent, tokens)], kv, top=top, mac_key=mac_key)


def decode_chunk(
    data: bytes | memoryview, spec: BlockSpec, *, mac_key: bytes | None = None
) -> list[BlockValue] | Miss:
    """Check ``data`` against ``spec`` and return its blocks in chain order, or the first
    reason it cannot be used. Pure; never raises for bad bytes. With ``mac_key`` a value must
    carry a MAC made with that key. The caller compares the blocks with the ones it needs."""
    view = memoryview(data)
    if len(view) < _HEADER.size:
        return Miss("truncated header")
    (magic, version, flags, block_size, num_blocks, layers, heads, dim, kv_nbytes, ident_len,
     dtype_len) = _HEADER.unpack_from(view)  # fmt: skip
    if magic != MAGIC:
        return Miss("not a block value")
    if version != VERSION:
        return Miss(f"format version {version}, this reader has {VERSION}")
    start = _HEADER.size
    links_at = start + ident_len + dtype_len
    if num_blocks < 1 or len(view) < links_at + num_blocks * _LINK.size:
        return Miss("truncated or oversized value")
    links = [_LINK.unpack_from(view, links_at + i * _LINK.size) for i in range(num_blocks)]
    num_tokens = sum(n for _, _, n in links)
    tok_start = links_at + num_blocks * _LINK.size
    body_len = tok_start + num_tokens * TOKEN_BYTES + kv_nbytes
    mac_len = MAC_BYTES if flags & FLAG_MAC else 0
    if len(view) != body_len + _SUM.size + mac_len:
        return Miss("truncated or oversized value")
    if bytes(view[start : start + ident_len]) != spec.identity.encode():
        return Miss("another model's fingerprint")
    if bytes(view[start + ident_len : links_at]) != spec.dtype.encode():
        return Miss("another K/V dtype")
    shape = (block_size, layers, heads, dim, kv_nbytes)
    wanted = (spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if shape != (*wanted, spec.block_nbytes * num_blocks):
        return Miss(f"shape {shape[:4]}, this engine has {wanted}")
    for i, (_, _, n) in enumerate(links):
        if not (n == block_size if i < num_blocks - 1 else 1 <= n <= block_size):
            return Miss(f"{n} tokens in a block of {block_size}")
    (checksum,) = _SUM.unpack_from(view, body_len)
    if xxh3_64_intdigest(view[:body_len]) != checksum:
        return Miss("checksum mismatch")
    if mac_key:
        if not mac_len:
            return Miss("no MAC, and a cache key is set")
        expected = hmac.new(mac_key, view[: body_len + _SUM.size], hashlib.sha256).digest()
        if not hmac.compare_digest(expected, bytes(view[body_len + _SUM.size :])):
            return Miss("MAC mismatch")
    out: list[BlockValue] = []
    tok, kv_at = tok_start, body_len - kv_nbytes
    for i, (key, parent, n) in enumerate(links):
        tokens = bytes(view[tok : tok + n * TOKEN_BYTES])
        if hash_packed_block(parent, tokens) != key:
            return Miss("its hash does not follow from its parent and tokens")
        if i and parent != out[-1].key:
            return Miss("its blocks do not follow each other")
        kv = view[kv_at + i * spec.block_nbytes : kv_at + (i + 1) * spec.block_nbytes]
        out.append(BlockValue(key, parent, tokens, i == 0 and bool(flags & FLAG_TOP), kv))
        tok += n * TOKEN_BYTES
    return out


def decode(
    data: bytes | memoryview,
    spec: BlockSpec,
    *,
    mac_key: bytes | None = None,
    key: int | None = None,
    parent: int | None = None,
    tokens: bytes | None = None,
) -> BlockValue | Miss:
    """A value of one block, checked against ``spec`` (and the expected ``key`` / ``parent`` /
    ``tokens`` where given), or the first reason it cannot be used. Pure; never raises."""
    blocks = decode_chunk(data, spec, mac_key=mac_key)
    if isinstance(blocks, Miss):
        return blocks
    if len(blocks) != 1:
        return Miss(f"a chunk of {len(blocks)} blocks where one block was expected")
    return expect(blocks[0], key=key, parent=parent, tokens=tokens) or blocks[0]


def expect(
    block: BlockValue,
    *,
    key: int | None = None,
    parent: int | None = None,
    tokens: bytes | None = None,
) -> Miss | None:
    """Why a decoded block is not the one a reader needs, or None when it is. Pure."""
    if key is not None and block.key != key:
        return Miss("another block's hash")
    if parent is not None and block.parent != parent:
        return Miss("another parent")
    if tokens is not None and block.tokens != tokens:
        return Miss("other tokens")
    return None


def storage_key(spec: BlockSpec, block_hash: int) -> str:
    """The key a value is stored under in every tier: the chained hash of its (last) block,
    rooted in the model's fingerprint and the request's cache_salt, plus the K/V dtype, block
    size and format version (and a hash of the identity: weights rounded otherwise give other
    K/V under the same fingerprint), so engines that differ in any of them never read each
    other's values nor overwrite them. Pure."""
    ident = xxh3_64_intdigest(spec.identity.encode())
    return f"kvcache:v{VERSION}:{ident:016x}:{spec.dtype}:{spec.block_size}:{block_hash:016x}"


def value_blocks(data: bytes | memoryview) -> int:
    """How many blocks a value says it holds, read from its header alone (1 when the header is
    not one: decoding then says why). Pure; a hint for choosing which value to decode."""
    if len(data) < _HEADER.size or bytes(data[:4]) != MAGIC:
        return 1
    return max(1, _HEADER.unpack_from(data)[4])


def value_links(data: bytes | memoryview) -> tuple[bool, list[Link]] | None:
    """(whether its first block is a chain's top, its blocks' hashes, parents and tokens), read
    from a value's header and tokens alone, unverified (None when they do not parse): what a
    KV event announces of a value a tier took (kvcache.tiers.listener.py). Pure."""
    view = memoryview(data)
    if len(view) < _HEADER.size or bytes(view[:4]) != MAGIC:
        return None
    head = _HEADER.unpack_from(view)
    flags, num_blocks, ident_len, dtype_len = head[2], head[4], head[9], head[10]
    links_at = _HEADER.size + ident_len + dtype_len
    tok_at = links_at + num_blocks * _LINK.size
    if head[1] != VERSION or len(view) < tok_at:
        return None
    links = []
    for i in range(num_blocks):
        key, parent, n = _LINK.unpack_from(view, links_at + i * _LINK.size)
        tokens = bytes(view[tok_at : tok_at + n * TOKEN_BYTES])
        if len(tokens) != n * TOKEN_BYTES:
            return None
        links.append(Link(key, parent, tokens))
        tok_at += n * TOKEN_BYTES
    return bool(flags & FLAG_TOP), links
