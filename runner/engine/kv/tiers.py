"""The engine's tiers below the device pool, opened from its options: the host, disk and
Redis tiers in one store (kvcache/tiers), the loader that moves blocks between them and the pool
(kvcache/tiers/loader.py), the MAC key stored blocks carry, and what their K/V depend on."""

from __future__ import annotations

import os

from kvcache import BlockManager
from kvcache.tiers import BlockSpec, DiskTier, HostTier, RemoteTier, TieredStore
from kvcache.tiers.loader import PoolBlocks, TierLoader
from kvcache.tiers.writer import Tier
from runner.engine.config import EngineConfig

KEY_ENV = "KVCACHE_CACHE_KEY"


def cache_mac_key(config: EngineConfig) -> bytes | None:
    """The MAC key: EngineConfig.cache_key, else the environment's KVCACHE_CACHE_KEY. Raises
    ValueError when require_cache_mac is set and neither is."""
    key = config.cache_key if config.cache_key is not None else os.environ.get(KEY_ENV)
    if config.require_cache_mac and not key:
        raise ValueError(f"require_cache_mac needs cache_key= (or {KEY_ENV}) to be set")
    return key.encode() if key else None


def cache_identity_string(fingerprint: str, weights: str) -> str:
    """What a stored block's K/V depend on beyond its tokens: the weights and their rounding."""
    return f"{fingerprint}|weights={weights}"


def open_tiers(
    config: EngineConfig, bm: BlockManager, pool: PoolBlocks, spec: BlockSpec
) -> TierLoader:
    """The tiers the options name, over `pool` (one worker's, or the tensor-parallel ranks')."""
    tiers: list[Tier] = []
    host = HostTier(config.host_cache_bytes) if config.host_cache_bytes else None
    if host is not None:
        tiers.append(host)
    if config.disk_cache_dir:
        tiers.append(DiskTier(config.disk_cache_dir, config.disk_cache_bytes))
    if config.remote_cache_url:
        tiers.append(RemoteTier(config.remote_cache_url))
    chunk_blocks = max(1, config.cache_chunk_tokens // config.block_size)
    store = TieredStore(spec, tiers, mac_key=cache_mac_key(config), chunk_blocks=chunk_blocks)
    return TierLoader(bm, store, pool, config.block_size, host)
