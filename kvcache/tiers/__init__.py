"""kvcache.tiers: the KV store below the device pool, in pure Python (bytes in, bytes out).

What it owns: the one format of KV stored outside the pool (``block_value``: a block or a
chunk of blocks, header, tokens, raw K/V, checksum, optional keyed MAC), the tiers that
hold such values (``host``: a bounded LRU in RAM; ``disk``: a directory that survives
restarts; ``remote``: a Redis server shared by every engine), ``tiered``: lookup of a
chain across them (``chain_reads``: which values it reads, nothing past a gap),
``writer``: the bounded background writer, ``write_backlog``: committed blocks
waiting in the pool for room in its queue, ``listener``: what the host and disk tiers tell a
listener of the values they store and let go (KV events), and ``loader``: which of the block
manager's blocks go down to the tiers and how hits come back up. It imports neither torch nor
``runner``: the engine copies K/V in and out of the pool (runner/engine/kv/transfer.py, or
the tensor-parallel ranks) and hands this package bytes.

May import: the rest of kvcache (its hashing), redis and xxhash; never torch nor runner.
"""

from kvcache.tiers.block_value import (
    BlockSpec,
    BlockValue,
    Link,
    Miss,
    decode,
    decode_chunk,
    encode,
    encode_chunk,
    storage_key,
)
from kvcache.tiers.disk import DiskTier
from kvcache.tiers.host import HostTier
from kvcache.tiers.remote import RemoteTier
from kvcache.tiers.tiered import Hit, Pending, TierCounters, TierDown, TieredStore

__all__ = [
    "BlockSpec",
    "BlockValue",
    "DiskTier",
    "Hit",
    "HostTier",
    "Link",
    "Miss",
    "Pending",
    "RemoteTier",
    "TierCounters",
    "TierDown",
    "TieredStore",
    "decode",
    "decode_chunk",
    "encode",
    "encode_chunk",
    "storage_key",
]
