"""The host and disk tiers against a simple reference, as hypothesis state machines: capacity
is never exceeded (the disk's counted on what is really on disk), the host evicts in exact LRU
order, the disk never returns a value other than the last one put under a key and keeps what
it holds across a restart."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.tiers import DiskTier, HostTier

KEYS = st.sampled_from([f"k{i}" for i in range(8)])
VALUES = st.binary(min_size=0, max_size=300)


class HostMachine(RuleBasedStateMachine):
    CAPACITY = 700

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(self.CAPACITY)
        self.ref: OrderedDict[str, bytes] = OrderedDict()

    @rule(key=KEYS, value=VALUES)
    def put(self, key: str, value: bytes) -> None:
        stored = self.tier.put(key, value)
        assert stored == (len(value) <= self.CAPACITY)
        self.ref.pop(key, None)
        while sum(map(len, self.ref.values())) + len(value) > self.CAPACITY:
            self.ref.popitem(last=False)
        self.ref[key] = value

    @rule(keys=st.lists(KEYS, max_size=4))
    def get(self, keys: list[str]) -> None:
        got = self.tier.get_many(keys)
        assert got == [self.ref.get(k) for k in keys]
        for k in keys:
            if k in self.ref:
                self.ref.move_to_end(k)

    @rule(key=KEYS)
    def discard(self, key: str) -> None:
        self.tier.discard(key)
        self.ref.pop(key, None)

    @rule(keys=st.lists(KEYS, max_size=4))
    def has(self, keys: list[str]) -> None:
        """Asking is not a use: the LRU order stays (the invariant checks it)."""
        assert self.tier.has_many(keys) == [k in self.ref for k in keys]

    @invariant()
    def same_as_reference(self) -> None:
        assert self.tier.keys() == list(self.ref)  # LRU order, oldest first
        assert self.tier.nbytes == sum(map(len, self.ref.values())) <= self.CAPACITY


class DiskMachine(RuleBasedStateMachine):
    CAPACITY = 6 * 4096  # a few files: each takes at least a filesystem block

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp())
        self.tier = DiskTier(self.root, self.CAPACITY)
        self.last: dict[str, bytes] = {}  # the last value put under each key

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(key=KEYS, value=VALUES)
    def put(self, key: str, value: bytes) -> None:
        assert self.tier.put(key, value)
        self.last[key] = value
        assert self.tier.get_many([key]) == [value]  # the newest write always fits

    @rule(keys=st.lists(KEYS, max_size=4))
    def get(self, keys: list[str]) -> None:
        for key, got in zip(keys, self.tier.get_many(keys), strict=True):
            assert got is None or got == self.last.get(key)

    @rule(keys=st.lists(KEYS, max_size=4))
    def has(self, keys: list[str]) -> None:
        """A key the tier says it has reads back as its last value, and asking touches
        nothing: no file's modification time changes."""
        times = {e.name: e.stat().st_mtime_ns for e in os.scandir(self.root)}
        held = self.tier.has_many(keys)
        assert times == {e.name: e.stat().st_mtime_ns for e in os.scandir(self.root)}
        for key, has, got in zip(keys, held, self.tier.get_many(keys), strict=True):
            assert has == (got is not None) and (got is None or got == self.last[key])

    @rule()
    def restart(self) -> None:
        held = {k for k, v in zip(self.last, self.tier.get_many(list(self.last)), strict=True) if v}
        self.tier = DiskTier(self.root, self.CAPACITY)
        after = self.tier.get_many(sorted(held))
        assert after == [self.last[k] for k in sorted(held)]  # the index came back whole

    @precondition(lambda self: bool(self.last))
    @rule(data=st.data())
    def another_process_writes(self, data: st.DataObject) -> None:
        """A file this process did not write counts once it rescans."""
        name = data.draw(st.sampled_from(["x1", "x2"]))
        (self.root / DiskTier.file_name(name)).write_bytes(b"z" * 5000)
        self.tier = DiskTier(self.root, self.CAPACITY)

    @invariant()
    def under_the_limit_on_disk(self) -> None:
        used = 0
        for entry in os.scandir(self.root):
            st_ = entry.stat()
            used += max(st_.st_size, st_.st_blocks * 512)
        assert used <= self.CAPACITY
        assert self.tier.nbytes <= self.CAPACITY
        assert not [p for p in os.listdir(self.root) if p.startswith(".tmp-")]


TestHostTier = HostMachine.TestCase
TestHostTier.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestDiskTier = DiskMachine.TestCase
TestDiskTier.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)


def test_a_disk_tier_never_grows_past_its_limit(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 64 * 1024)
    for i in range(200):
        tier.put(f"key{i}", bytes(3000))
    used = sum(max(e.stat().st_size, e.stat().st_blocks * 512) for e in os.scandir(tmp_path))
    assert used <= 64 * 1024 and len(tier) >= 10
    assert tier.get_many(["key199"]) == [bytes(3000)]  # the newest stays
    assert tier.get_many(["key0"]) == [None]  # the oldest went
