"""Saving the prefix cache to a file and loading it into another engine: a warm start.

A saved cache is a short envelope (a magic line and what the K/V depend on, as JSON: the model's
fingerprint, its weight rounding, the block size, the K/V layout and dtype) followed by every
block of the radix tree, each after its parent, then every tail, each one a block value of
kvcache/tiers/block_value.py: the one format of a block stored outside the pool, the tiers'
too, with its own checksum and, when a cache key is set, its MAC. A value that fails its checks
(flipped bytes, a wrong MAC) is dropped with its descendants, with a warning; the rest loads.

Loading rebuilds the chains through the block manager's own calls, so its invariants hold as
for any request: each leaf's path is allocated (the part already loaded matches and is held,
the rest takes fresh blocks), the fresh blocks get their K/V, the path is committed into the
tree and the allocation freed, with its tail's tokens when the leaf is a tail (so the free
keeps it, as a finished request's). The blocks are left cached and evictable, and the hit
counters count none of it.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

from kvcache import BlockManager, Purpose
from kvcache.hashing import TOKEN_BYTES, hash_packed_block, pack_tokens, unpack_tokens
from kvcache.tiers import BlockSpec, BlockValue, Miss, decode, encode
from runner.engine.kv.transfer import read_blocks, write_blocks
from runner.kv_pool.store import KVStore

FORMAT = "kvcache-prefix-cache/4"  # 4: block values of version 2 (kvcache/tiers/block_value.py)
MAGIC = b"KVCACHE-PREFIX-CACHE\n"
_LEN = struct.Struct("<Q")


def cache_identity(kv: KVStore, fingerprint: str, weights: str) -> dict[str, str]:
    """What a saved cache must share with the engine that loads it."""
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "weights": weights,
        "block_size": str(kv.block_size),
        "kv_layout": f"{kv.num_layers} layers x {kv.num_kv_heads} heads x {kv.head_dim}",
        "kv_dtype": kv.dtype_name,
    }


def save_prefix_cache(
    block_manager: BlockManager,
    kv: KVStore,
    identity: dict[str, str],
    path: Path,
    spec: BlockSpec,
    mac_key: bytes | None = None,
) -> int:
    """Write every block of the tree, every tail and their K/V to `path` (replaced whole,
    never half written); returns the number of blocks."""
    blocks = block_manager.cached_blocks()  # each after its parent
    hashes: dict[int, int] = {}  # block id -> its chained hash
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(partial, "wb") as f:
            head = json.dumps(identity, sort_keys=True).encode()
            f.write(MAGIC + _LEN.pack(len(head)) + head)
            for start in range(0, len(blocks), 256):  # K/V copied off the pool a slice at a time
                chunk = blocks[start : start + 256]
                payloads = read_blocks(kv, [b.block_id for b in chunk])
                for block, payload in zip(chunk, payloads, strict=True):
                    parent = block.root if block.parent is None else hashes[block.parent]
                    tokens = pack_tokens(block.token_ids)
                    key = hashes[block.block_id] = hash_packed_block(parent, tokens)
                    value = encode(
                        spec, key, parent, tokens, payload, top=block.parent is None,
                        mac_key=mac_key,
                    )  # fmt: skip
                    f.write(_LEN.pack(len(value)) + value)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return len(blocks)


def load_prefix_cache(
    block_manager: BlockManager,
    kv: KVStore,
    identity: dict[str, str],
    path: Path,
    request_id: int,
    spec: BlockSpec,
    mac_key: bytes | None = None,
    vocab_size: int | None = None,
) -> int:
    """Rebuild the cache saved in `path` into `block_manager` and `kv` (`request_id`: an id no
    live request has, used while each chain is loaded). Returns the blocks loaded: fewer than
    saved when the free blocks run out (nothing cached is evicted for it), when some were
    cached already, or when some failed their checks (dropped with their descendants, with a
    warning). Raises ValueError naming the problem for a file that is not a saved cache or was
    saved for another model or layout; nothing is loaded then."""
    block_manager.require_cache("nothing to load it into")
    values = _read(path, identity, spec, mac_key)
    if vocab_size is not None:
        check_token_ids(values, vocab_size, path)
    B = block_manager.block_size
    parents = {v.parent for v in values}
    by_key = {v.key: v for v in values if len(v.tokens) == B * TOKEN_BYTES}  # full blocks
    cached_before = block_manager.stats.blocks_cached
    for leaf in (v for v in values if v.key not in parents):  # tails are never parents
        chain = [leaf]
        while not chain[-1].top:
            chain.append(by_key[chain[-1].parent])
        chain.reverse()
        root = chain[0].parent
        known = unpack_tokens(b"".join(v.tokens for v in chain))
        full = len(chain) if len(known) == len(chain) * B else len(chain) - 1  # before a tail
        probe = known + [0]  # one more token: every full block matches
        if block_manager.blocks_needed(probe, root) > block_manager.stats.blocks_free:
            continue  # only free blocks: a chain must not evict one loaded before it
        alloc = block_manager.allocate(request_id, probe, root, Purpose.LOADING)
        have = alloc.num_cached_tokens // B
        try:  # the K/V of every fresh block of the chain (a tail's own block included)
            if have < len(chain):
                fresh = alloc.block_table[have : len(chain)]
                write_blocks(kv, fresh, [v.kv for v in chain[have:]])
            block_manager.commit(request_id, probe, full * B)
        finally:  # with its tokens: a tail's block stays cached as a tail
            block_manager.free(request_id, known, len(known) if have < len(chain) else 0)
    return block_manager.stats.blocks_cached - cached_before


def check_token_ids(values: list[BlockValue], vocab_size: int, path: Path) -> None:
    """Raise ValueError when a saved block holds a token id outside the vocabulary: its checks
    pass without a MAC key (a crafter recomputes hashes and checksums), and such an id, loaded,
    would be fed to the model as a speculative guess (an IndexError in the embedding)."""
    for i, value in enumerate(values):
        bad = [t for t in unpack_tokens(value.tokens) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"{path}: block {i} holds token id {bad[0]}, outside the vocabulary "
                f"[0, {vocab_size}) (a damaged or crafted file)"
            )


def _read(
    path: Path, identity: dict[str, str], spec: BlockSpec, mac_key: bytes | None
) -> list[BlockValue]:
    """The file's values that pass their checks and hang under a value that does (each after
    its parent), once its envelope says it fits this engine. Warns about the ones dropped."""
    try:
        data = memoryview(path.read_bytes())
    except OSError as err:
        raise ValueError(f"{path}: not a readable prefix cache file ({err})") from err
    if not data[: len(MAGIC)] == MAGIC or len(data) < len(MAGIC) + _LEN.size:
        raise ValueError(f"{path}: not a readable prefix cache file (no kvcache header)")
    (head_len,) = _LEN.unpack_from(data, len(MAGIC))
    offset = len(MAGIC) + _LEN.size + head_len
    try:
        saved = json.loads(bytes(data[len(MAGIC) + _LEN.size : offset]))
    except ValueError as err:
        raise ValueError(f"{path}: not a readable prefix cache file ({err})") from err
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"{path}: not a kvcache prefix cache file of {FORMAT}")
    for key, ours in identity.items():
        if key != "format" and saved.get(key) != ours:
            raise ValueError(
                f"{path}: saved for {key} {saved.get(key)!r}, this engine has {ours!r}"
            )
    kept: list[BlockValue] = []
    full_keys: set[int] = set()
    dropped: list[str] = []
    orphans = 0
    while offset < len(data):
        if offset + _LEN.size > len(data):
            dropped.append("a truncated entry")
            break
        (length,) = _LEN.unpack_from(data, offset)
        value = decode(
            data[offset + _LEN.size : offset + _LEN.size + length], spec, mac_key=mac_key
        )
        offset += _LEN.size + length
        if isinstance(value, Miss):
            dropped.append(value.reason)
        elif not value.top and value.parent not in full_keys:
            orphans += 1  # below a dropped block: its K/V depend on that block's
        else:
            kept.append(value)
            if len(value.tokens) == spec.block_size * TOKEN_BYTES:
                full_keys.add(value.key)
    if dropped:
        warnings.warn(
            f"{path}: {len(dropped)} blocks failed their checks ({dropped[0]}) and were dropped"
            f" with {orphans} blocks below them; the rest loads",
            stacklevel=3,
        )
    elif orphans:
        warnings.warn(
            f"{path}: {orphans} blocks have no parent block in the file (their K/V depend on"
            " it) and were dropped; the rest loads",
            stacklevel=3,
        )
    return kept
