"""The disk tier's faults from the file system itself (no mocks): a directory this process may
read but not write (a cache shipped read-only) still serves hits, though the touch that makes
a hit recent fails; a directory deleted under a running engine is made again by the next
write; a write that fails is warned as a failed write, not as a miss."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tier_values import ROOT, SPEC, chain, value_of

from kvcache.tiers import DiskTier, Pending, TieredStore

TOKENS = list(range(100, 116))  # four blocks of four


def lookup(store: TieredStore) -> int:
    links = chain(TOKENS)
    return len(store.lookup([h for h, _, _ in links], ROOT, [t for _, _, t in links]))


def fill(root: Path) -> None:
    disk = DiskTier(root, 10**6)
    for i in range(len(TOKENS) // SPEC.block_size):
        key, value = value_of(TOKENS, i, seed=i)
        disk.put(TieredStore(SPEC, []).key_of(key), value)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A cache directory nobody may change. As root, permission bits stop nothing, so the
    directory and its files are made immutable (``chattr +i``: even root's ``utime`` then
    fails with EPERM); as anyone else, they lose their write permission."""
    root = tmp_path / "cache"
    fill(root)
    paths = [*root.iterdir(), root]
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        if chattr is None or subprocess.run([chattr, "+i", *map(str, paths)]).returncode:
            pytest.skip("running as root on a file system without chattr +i")
        try:
            yield root
        finally:
            subprocess.run([chattr, "-i", *map(str, paths)], check=True)
    else:
        for path in paths:
            path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield root
        finally:
            for path in paths:
                path.chmod(0o755 if path.is_dir() else 0o644)


def test_a_read_only_directory_still_serves_hits(read_only_dir: Path) -> None:
    some_file = next(read_only_dir.iterdir())
    with pytest.raises(PermissionError):
        os.utime(some_file)  # the touch after a read fails here, as on a read-only mount
    warnings: list[str] = []
    store = TieredStore(SPEC, [DiskTier(read_only_dir, 10**6)], warn=warnings.append)
    assert lookup(store) == 4
    assert store.counters["disk"].hit_blocks == 4 and store.counters["disk"].errors == 0
    assert lookup(store) == 4  # the index kept its files: still hits
    assert warnings == []
    store.close()


def test_a_deleted_directory_is_made_again_by_the_next_write(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    fill(root)
    warnings: list[str] = []
    store = TieredStore(SPEC, [DiskTier(root, 10**6)], warn=warnings.append)
    assert lookup(store) == 4
    shutil.rmtree(root)  # a cleanup job, an operator
    assert lookup(store) == 0  # a miss, not an error
    links = chain(TOKENS)
    blocks = [
        Pending(h, p, t, i == 0, bytes(SPEC.block_nbytes)) for i, (h, p, t) in enumerate(links)
    ]
    assert store.write(("disk",), blocks) == 0
    store.flush()
    assert store.counters["disk"].errors == 0 and store.counters["disk"].written_blocks == 4
    assert lookup(store) == 4 and len(list(root.iterdir())) == 4
    assert warnings == []
    store.close()


def test_a_failed_write_is_warned_as_a_failed_write(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    warnings: list[str] = []
    store = TieredStore(SPEC, [DiskTier(root, 10**6)], warn=warnings.append)
    root.rmdir()
    root.write_bytes(b"not a directory")  # the directory cannot be made again
    key, parent, tokens = chain(TOKENS)[0]
    store.write(("disk",), [Pending(key, parent, tokens, True, bytes(SPEC.block_nbytes))])
    store.flush()
    assert store.counters["disk"].errors == 1 and store.counters["disk"].written_blocks == 0
    assert len(warnings) == 1 and "write failed" in warnings[0]
    assert "miss" not in warnings[0]
    store.close()
