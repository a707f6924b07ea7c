"""The remote tier follows chains: a Redis with ``maxmemory`` evicts values from the middle of
chains, and a lookup then reads nothing past a chain's first gap (it asks with ``EXISTS``,
which Redis does not count as a use, and reads only the values that continue the chain), so
it neither pays for values it cannot serve nor makes them recent: unreachable values stay the
least recently used and go first. Against real redis-servers (tests/redis_server.py)."""

from __future__ import annotations

import random
from pathlib import Path

import redis
from tier_values import ROOT, chain

from kvcache.tiers import BlockSpec, HostTier, Pending, RemoteTier, TieredStore
from kvcache.tiers.prefetch import Prefetcher
from tests.redis_server import RedisServer

C = 4  # blocks a chunk
BLOCKS = 12  # three chunks a chain
# Blocks of 4 KiB of K/V, so that one value read for nothing dwarfs the replies' framing.
SPEC = BlockSpec("model-a|weights=float32", "float32", 4, 1, 1, 128, 2 * 1 * 4 * 1 * 128 * 4)


def tokens_of(i: int) -> list[int]:
    return [10_000 * (i + 1) + t for t in range(BLOCKS * SPEC.block_size)]


def write_chain(store: TieredStore, i: int) -> list[str]:
    """Chain ``i`` down as the engine writes it (three chunks, each keyed by its last block);
    returns the three values' keys."""
    rng = random.Random(i)
    blocks = [
        Pending(h, p, t, n == 0, rng.randbytes(SPEC.block_nbytes))
        for n, (h, p, t) in enumerate(chain(tokens_of(i)))
    ]
    chunks = [blocks[k : k + C] for k in range(0, BLOCKS, C)]
    assert store.write_chunks(("remote",), chunks) == 0
    store.flush()
    return [store.key_of(chunk[-1].key) for chunk in chunks]


def lookup(store: TieredStore, i: int) -> int:
    links = chain(tokens_of(i))
    return len(store.lookup([h for h, _, _ in links], ROOT, [t for _, _, t in links]))


def test_a_lookup_neither_reads_nor_refreshes_what_follows_a_gap(
    redis_server: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "allkeys-lfu")  # OBJECT FREQ counts every use
    store = TieredStore(SPEC, [RemoteTier(redis_server.url)], chunk_blocks=C)
    keys = write_chain(store, 0)
    client.delete(keys[1])  # as an eviction would: blocks 4..7 gone
    before = [client.object("freq", key) for key in (keys[0], keys[2])]
    assert lookup(store, 0) == C  # the first chunk; the third is unreachable
    after = [client.object("freq", key) for key in (keys[0], keys[2])]
    assert after[0] > before[0]  # served: a use
    assert after[1] == before[1]  # past the gap: neither read nor made recent
    remote = store.counters["remote"]
    assert remote.fetched_values == 1 and remote.fetched_bytes == remote.read_bytes
    store.close()


def test_an_lru_redis_evicting_mid_chain_sends_only_what_is_served(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        used = int(client.info("memory")["used_memory"])
        # Room for about half of the 48 chains' 144 values of 16 KiB: LRU evicts at random
        # places (Redis samples keys), so chains lose chunks from their middles.
        client.config_set("maxmemory", used + 72 * 17 * 1024)
        client.config_set("maxmemory-policy", "allkeys-lru")
        store = TieredStore(SPEC, [RemoteTier(server.url)], chunk_blocks=C)
        written = [write_chain(store, i) for i in range(48)]
        client.delete(written[0][1])  # at least one gap for certain
        gaps = 0
        start = _sent(client)
        info_reply = _sent(client) - start  # what one INFO reply itself adds
        for i, keys in enumerate(written):
            present = [bool(client.exists(key)) for key in keys]  # EXISTS: no use
            gaps += any(not a and b for a, b in zip(present, present[1:], strict=False))
            served_before, sent_before = store.counters["remote"].read_bytes, _sent(client)
            found = lookup(store, i)
            sent = _sent(client) - sent_before - info_reply  # the lookup's replies alone
            served = store.counters["remote"].read_bytes - served_before
            assert found == C * (present + [False]).index(False)
            # Framing: 4 bytes an EXISTS reply, about 10 a value; a value read for nothing
            # would add 16 KiB.
            assert sent <= served + 16 * BLOCKS + 256, (i, present)
        assert gaps >= 1
        remote = store.counters["remote"]
        assert remote.fetched_bytes == remote.read_bytes and remote.rejected_blocks == 0
        store.close()
    finally:
        server.stop()


def _sent(client: redis.Redis) -> int:
    """Bytes the server has sent to all its clients so far."""
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_prefetch_reads_nothing_past_a_gap(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    host = HostTier(10**8)
    store = TieredStore(SPEC, [host, RemoteTier(redis_server.url)], chunk_blocks=C)
    keys = write_chain(store, 0)
    client.delete(keys[1])
    prefetcher = Prefetcher(store, host)
    prefetcher.prefetch([h for h, _, _ in chain(tokens_of(0))])
    prefetcher.flush()
    assert host.keys() == [keys[0]] and prefetcher.prefetched_blocks == C
    assert store.counters["remote"].fetched_values == 1
    prefetcher.close()
    store.close()
