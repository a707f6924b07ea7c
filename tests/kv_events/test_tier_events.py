"""KV events of the tiers below the pool: a subscriber decoding with vLLM's types sees the
host tier's blocks under medium CPU and the disk tier's under DISK, with the pool's chained
hashes, and rebuilds exactly what each tier holds, through evictions from every level and a
prefix-cache reset (whose AllBlocksCleared the tiers' blocks follow again)."""

from __future__ import annotations

import random
from pathlib import Path

from subscriber import Subscriber

from kvcache.hashing import unpack_tokens
from kvcache.tiers.block_value import value_links
from runner.engine.api.llm import LLM
from runner.kv_events.tier_events import MEDIA
from runner.sampling.params import SamplingParams

EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:0",
    "replay_endpoint": "tcp://127.0.0.1:0",
}
Blocks = dict[int, tuple[int | None, tuple[int, ...]]]


def held(values: list[bytes], block_size: int) -> Blocks:
    """What a tier's values hold, as a subscriber's view: hash -> (parent, tokens)."""
    out: Blocks = {}
    for value in values:
        parsed = value_links(value)
        assert parsed is not None
        top, links = parsed
        for i, link in enumerate(links):
            tokens = tuple(unpack_tokens(link.tokens))
            if len(tokens) == block_size:
                out[link.key] = (None if top and i == 0 else link.parent, tokens)
    return out


def tier_views(llm: LLM, disk: Path) -> dict[str, Blocks]:
    assert llm.tiers is not None and llm.tiers.host is not None
    host = llm.tiers.host
    host_values = [v for v in host.get_many(host.keys()) if v is not None]
    disk_values = [f.read_bytes() for f in sorted(disk.glob("*.kvb"))]
    size = llm.config.block_size
    return {"CPU": held(host_values, size), "DISK": held(disk_values, size)}


def test_a_subscriber_rebuilds_each_tier(tiny_llama_dir: Path, tmp_path: Path) -> None:
    probe = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    block_bytes = probe.block_spec.block_nbytes
    del probe
    disk = tmp_path / "disk"
    llm = LLM(
        str(tiny_llama_dir),
        num_kv_blocks=24,  # an eviction storm: every prompt evicts blocks to the host tier
        block_size=4,
        cache_chunk_tokens=8,  # chunks of two blocks: values that hold several blocks
        host_cache_bytes=20 * block_bytes,  # room for ~18 blocks: it evicts too
        disk_cache_dir=str(disk),
        disk_cache_bytes=40 * (block_bytes + 8192),  # ~40 values: it evicts too
        kv_events_config=EVENTS,
    )
    publisher = llm.kv_events
    assert publisher is not None and llm.tiers is not None
    live = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    rng = random.Random(7)
    stems = [[rng.randrange(3, 300) for _ in range(rng.randrange(8, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0)
    try:
        for _ in range(4):
            batch = [
                rng.choice(stems) + [rng.randrange(3, 300) for _ in range(9)] for _ in range(8)
            ]
            llm.generate(batch, params)
            llm.tiers.flush()
            live.drain()
            views = tier_views(llm, disk)
            assert views["CPU"] and views["DISK"]
            for medium in MEDIA.values():
                assert live.views.get(medium, {}) == views[medium], medium
        assert live.media == {"GPU", "CPU", "DISK"}
        assert all(live.removed.get(medium) for medium in ("GPU", "CPU", "DISK")), live.removed
        # A reset empties the pool, not the tiers: the subscriber clears every medium on the
        # AllBlocksCleared and learns the tiers' blocks again from what follows it.
        assert llm.reset_prefix_cache()
        live.drain()
        assert live.blocks == {}
        views = tier_views(llm, disk)
        for medium in MEDIA.values():
            assert live.views.get(medium, {}) == views[medium], medium
    finally:
        live.close()
        publisher.close()
