"""The one format of a KV block stored outside the device pool: a tier, a cache file.

A value is a small fixed header, the block's tokens and its raw K/V bytes, then an xxh3
checksum of everything before it and, when a key is configured, an HMAC-SHA256 of everything
before that. No pickle, no torch: bytes in, bytes out. Layout (little-endian):

    magic b"KVCB" | version u16 | flags u16 | block_size u32 | num_tokens u32
    | num_layers u32 | num_kv_heads u32 | head_dim u32 | key u64 | parent u64 | kv_nbytes u64
    | identity_len u16 | dtype_len u16 | identity | dtype
    | tokens (num_tokens x int64) | K/V (kv_nbytes: [layers, 2, block_size, heads, head_dim])
    | checksum u64 (xxh3_64 of all of the above)
    | mac (32 bytes, HMAC-SHA256 of all of the above; only when flags has FLAG_MAC)

``key`` is the block's chained hash (``hashing.hash_packed_block(parent, tokens)``), so a
value names its own place in the chain; ``decode`` recomputes it. Without a MAC key the
checksum catches damage, not forgery: a value is then trusted input, like a model file.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

from xxhash import xxh3_64_intdigest

from kvcache.hashing import TOKEN_BYTES, hash_packed_block

MAGIC = b"KVCB"
VERSION = 1
FLAG_TOP = 1  # the parent hash is a namespace root (no block above this one)
FLAG_MAC = 2  # a MAC follows the checksum
_HEADER = struct.Struct("<4sHHIIIIIQQQHH")
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
    """A decoded value that passed every check."""

    key: int  # chained hash of this block
    parent: int  # the parent block's hash, or the namespace root when ``top``
    tokens: bytes  # packed int64 tokens (num_tokens of them; fewer than a block for a tail)
    top: bool
    kv: memoryview  # the K/V bytes (a view into the encoded value)


class Miss(NamedTuple):
    """Why a value was not used."""

    reason: str


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
    """One value (see the module docstring). Pure. Raises ValueError when the parts do not fit
    ``spec``: a writer never stores what no reader could use."""
    num_tokens = len(tokens) // TOKEN_BYTES
    if len(tokens) % TOKEN_BYTES or not 1 <= num_tokens <= spec.block_size:
        raise ValueError(f"a block holds 1..{spec.block_size} tokens, got {len(tokens)} bytes")
    if len(kv) != spec.block_nbytes:
        raise ValueError(f"a block's K/V is {spec.block_nbytes} bytes, got {len(kv)}")
    ident, dtype = spec.identity.encode(), spec.dtype.encode()
    flags = (FLAG_TOP if top else 0) | (FLAG_MAC if mac_key else 0)
    head = _HEADER.pack(
        MAGIC, VERSION, flags, spec.block_size, num_tokens, spec.num_layers,
        spec.num_kv_heads, spec.head_dim, key, parent, len(kv), len(ident), len(dtype),
    )  # fmt: skip
    body = b"".join((head, ident, dtype, tokens, kv))
    checksum = _SUM.pack(xxh3_64_intdigest(body))
    if not mac_key:
        return body + checksum
    mac = hmac.new(mac_key, body, hashlib.sha256)
    mac.update(checksum)
    return body + checksum + mac.digest()


def decode(
    data: bytes | memoryview,
    spec: BlockSpec,
    *,
    mac_key: bytes | None = None,
    key: int | None = None,
    parent: int | None = None,
    tokens: bytes | None = None,
) -> BlockValue | Miss:
    """Check ``data`` against ``spec`` (and the expected ``key`` / ``parent`` / ``tokens``
    where given) and return it, or the first reason it cannot be used. Pure; never raises
    for bad bytes. With ``mac_key`` a value must carry a MAC made with that key."""
    view = memoryview(data)
    if len(view) < _HEADER.size:
        return Miss("truncated header")
    (magic, version, flags, block_size, num_tokens, layers, heads, dim, own_key, own_parent,
     kv_nbytes, ident_len, dtype_len) = _HEADER.unpack_from(view)  # fmt: skip
    if magic != MAGIC:
        return Miss("not a block value")
    if version != VERSION:
        return Miss(f"format version {version}, this reader has {VERSION}")
    start = _HEADER.size
    body_len = start + ident_len + dtype_len + num_tokens * TOKEN_BYTES + kv_nbytes
    mac_len = MAC_BYTES if flags & FLAG_MAC else 0
    if len(view) != body_len + _SUM.size + mac_len:
        return Miss("truncated or oversized value")
    if bytes(view[start : start + ident_len]) != spec.identity.encode():
        return Miss("another model's fingerprint")
    if bytes(view[start + ident_len : start + ident_len + dtype_len]) != spec.dtype.encode():
        return Miss("another K/V dtype")
    shape = (block_size, layers, heads, dim, kv_nbytes)
    wanted = (spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if shape != (*wanted, spec.block_nbytes):
        return Miss(f"shape {shape[:4]}, this engine has {wanted}")
    if not 1 <= num_tokens <= block_size:
        return Miss(f"{num_tokens} tokens in a block of {block_size}")
    (checksum,) = _SUM.unpack_from(view, body_len)
    if xxh3_64_intdigest(view[:body_len]) != checksum:
        return Miss("checksum mismatch")
    if mac_key:
        if not mac_len:
            return Miss("no MAC, and a cache key is set")
        expected = hmac.new(mac_key, view[: body_len + _SUM.size], hashlib.sha256).digest()
        if not hmac.compare_digest(expected, bytes(view[body_len + _SUM.size :])):
            return Miss("MAC mismatch")
    tok_start = start + ident_len + dtype_len
    own_tokens = bytes(view[tok_start : tok_start + num_tokens * TOKEN_BYTES])
    if hash_packed_block(own_parent, own_tokens) != own_key:
        return Miss("its hash does not follow from its parent and tokens")
    if key is not None and own_key != key:
        return Miss("another block's hash")
    if parent is not None and own_parent != parent:
        return Miss("another parent")
    if tokens is not None and own_tokens != tokens:
        return Miss("other tokens")
    kv = view[tok_start + num_tokens * TOKEN_BYTES : body_len]
    return BlockValue(own_key, own_parent, own_tokens, bool(flags & FLAG_TOP), kv)


def storage_key(spec: BlockSpec, block_hash: int) -> str:
    """The key a block is stored under in every tier: its chained hash (rooted in the model's
    fingerprint and the request's cache_salt) plus the K/V dtype, block size and format
    version (and a hash of the identity: weights rounded otherwise give other K/V under the
    same fingerprint), so engines that differ in any of them never read each other's values
    nor overwrite them. Pure."""
    ident = xxh3_64_intdigest(spec.identity.encode())
    return f"kvcache:v{VERSION}:{ident:016x}:{spec.dtype}:{spec.block_size}:{block_hash:016x}"
