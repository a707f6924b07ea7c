"""The tiers in order: the longest verified run of a chain across them, damaged values on disk
read as misses (and deleted), a Redis server that is down or killed read as misses, warned
once and counted, with every value the server still has served once it is back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tier_values import ROOT, SPEC, chain, value_of

from kvcache.tiers import DiskTier, HostTier, Pending, RemoteTier, TieredStore
from kvcache.tiers.remote import MIN_BACKOFF_S
from tests.redis_server import RedisServer, free_port

TOKENS = list(range(100, 124))  # six blocks of four


def lookup(store: TieredStore, tokens: list[int] = TOKENS) -> list[str]:
    links = chain(tokens)
    hits = store.lookup([h for h, _, _ in links], ROOT, [t for _, _, t in links])
    return [hit.tier for hit in hits]


def put(
    tier: HostTier | DiskTier | RemoteTier, indices: range, mac_key: bytes | None = None
) -> None:
    for i in indices:
        key, value = value_of(TOKENS, i, seed=i, mac_key=mac_key)
        tier.put(f"{TieredStore(SPEC, []).key_of(key)}", value)


def test_a_chain_is_followed_across_tiers_up_to_its_first_gap(tmp_path: Path) -> None:
    host, disk = HostTier(10**6), DiskTier(tmp_path, 10**6)
    store = TieredStore(SPEC, [host, disk])
    put(host, range(0, 2))
    put(disk, range(1, 4))
    put(host, range(5, 6))  # after the gap at block 4: unreachable
    assert lookup(store) == ["host", "host", "disk", "disk"]
    assert store.counters["disk"].hit_blocks == 2
    store.close()


def test_damaged_files_are_misses_and_are_removed(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10**6)
    store = TieredStore(SPEC, [disk], warn=lambda message: None)
    put(disk, range(0, 4))
    files = sorted(tmp_path.iterdir(), key=lambda p: p.stat().st_mtime_ns)
    key_of_2 = store.key_of(chain(TOKENS)[2][0])
    damaged = disk.path_of(key_of_2)
    damaged.write_bytes(damaged.read_bytes()[:-9])  # torn: cut short
    assert lookup(store) == ["disk", "disk"]
    assert not damaged.exists() and store.counters["disk"].rejected_blocks == 1
    flipped = disk.path_of(store.key_of(chain(TOKENS)[1][0]))
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    assert lookup(store) == ["disk"]
    assert len(files) == 4
    store.close()


def test_written_blocks_reach_every_target_tier(tmp_path: Path, redis_server: RedisServer) -> None:
    host, disk, remote = HostTier(10**6), DiskTier(tmp_path, 10**6), RemoteTier(redis_server.url)
    store = TieredStore(SPEC, [host, disk, remote], mac_key=b"k")
    links = chain(TOKENS)
    blocks = [
        Pending(h, p, t, i == 0, bytes(SPEC.block_nbytes)) for i, (h, p, t) in enumerate(links)
    ]
    assert store.write(("disk", "remote"), blocks) == 0
    store.flush()
    assert len(disk) == 6 and len(host) == 0
    reader = TieredStore(SPEC, [RemoteTier(redis_server.url)], mac_key=b"k")
    assert lookup(reader) == ["remote"] * 6  # one MGET for the chain
    other_key = TieredStore(SPEC, [RemoteTier(redis_server.url)], mac_key=b"other", warn=print)
    assert lookup(other_key) == [] and other_key.counters["remote"].rejected_blocks == 1
    for s in (store, reader, other_key):
        s.close()


def test_a_dead_redis_is_a_miss_warned_once(tmp_path: Path) -> None:
    warnings: list[str] = []
    remote = RemoteTier(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    store = TieredStore(SPEC, [remote], warn=warnings.append)
    for _ in range(5):
        assert lookup(store) == []
    counters = store.counters["remote"]
    assert counters.errors == 1 and counters.skipped == 4  # backing off, not retrying each call
    assert len(warnings) == 1 and "unavailable" in warnings[0]
    store.write(("remote",), [Pending(1, 2, b"x" * 32, True, bytes(SPEC.block_nbytes))])
    store.flush()
    assert counters.written_blocks == 0
    store.close()


def test_redis_killed_and_restarted(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        remote = RemoteTier(server.url, timeout_s=0.2)
        store = TieredStore(SPEC, [remote], warn=lambda message: None)
        put(remote, range(0, 6))
        assert lookup(store) == ["remote"] * 6
        server.stop()
        assert lookup(store) == []
        assert store.counters["remote"].errors == 1
        server.start()  # same port, empty (no persistence)
        time.sleep(MIN_BACKOFF_S + 0.05)  # the backoff after one error
        assert lookup(store) == []  # reachable again, and empty: a miss, no error
        put(remote, range(0, 2))
        assert lookup(store) == ["remote"] * 2
        assert store.counters["remote"].errors == 1
        store.close()
    finally:
        server.stop()


def test_a_value_that_cannot_be_encoded_does_not_stop_the_writer(tmp_path: Path) -> None:
    """The writer thread outlives a value it cannot encode (here: a block of two blocks'
    tokens): the write is counted as failed, and the writes beside and after it still land."""
    disk = DiskTier(tmp_path, 10**6)
    store = TieredStore(SPEC, [disk])
    links = chain(TOKENS)
    key, parent, tokens = links[0]
    good = [Pending(h, p, t, i == 0, bytes(SPEC.block_nbytes)) for i, (h, p, t) in enumerate(links)]
    store.write(("disk",), [Pending(key, parent, tokens * 2, True, bytes(SPEC.block_nbytes))])
    store.write(("disk",), good[:3])
    store.flush()
    assert len(disk) == 3
    store.write(("disk",), good[3:])
    flushed = threading.Thread(target=store.flush, daemon=True)
    flushed.start()
    flushed.join(timeout=30)  # a dead writer would never finish this flush
    assert not flushed.is_alive() and len(disk) == 6
    assert store.stats()["failed_writes"] == 1
    store.close()
