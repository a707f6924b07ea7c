"""The disk tier: one file per block value in a directory, surviving restarts.

Writes are atomic (a temporary file in the same directory, then ``os.replace``), so a reader
sees a whole value or none; a torn or corrupt file still fails ``block_value.decode`` and is a
miss. The index (key -> bytes on disk, least recently used first) is rebuilt from the directory
at start, ordered by modification time (a hit touches its file), so a restarted process, or
another one pointed at the same directory, gets hits on what was written before. The byte
limit is enforced on what is really on disk: each file counts its allocated blocks (never less
than its size), and the directory is rescanned every ``RESCAN_EVERY`` writes so that files
other processes added count too.

Faults: a directory that is read-only to this process still serves hits (the touch that makes
a hit recent is skipped when it fails); a directory deleted under a running process is made
again by the next write, which starts a fresh index.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvcache.tiers.listener import TierListener

SUFFIX = ".kvb"
_TMP = ".tmp-"
RESCAN_EVERY = 256


def _footprint(st: os.stat_result) -> int:
    """Bytes a file takes on disk: its allocated blocks, never less than its length."""
    return max(st.st_size, getattr(st, "st_blocks", 0) * 512)


class DiskTier:
    """Block values as files under ``root``, never more than ``capacity_bytes`` on disk."""

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk_cache_bytes must be positive, got {capacity_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, oldest first
        self._bytes = 0
        self._writes = 0
        self._lock = threading.Lock()
        # Told of values this process stores and lets go (KV events); files found at start
        # or written by another process are never announced, nor their removal.
        self.listener: TierListener | None = None
        with self._lock:
            self._rescan(remove_temporary=True)
            self._shrink(0)

    @property
    def nbytes(self) -> int:
        """Bytes the indexed files take on disk now. Pure."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    @staticmethod
    def file_name(key: str) -> str:
        return key.replace(":", "-") + SUFFIX

    def path_of(self, key: str) -> Path:
        return self.root / self.file_name(key)

    def _rescan(self, remove_temporary: bool = False) -> None:
        """Rebuild the index from the directory (oldest modification first). A temporary file
        left by a writer that died is removed at start."""
        found: list[tuple[float, str, int]] = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                try:
                    if entry.name.startswith(_TMP):
                        if remove_temporary:
                            os.unlink(entry.path)
                        continue
                    if entry.name.endswith(SUFFIX) and entry.is_file():
                        st = entry.stat()
                        found.append((st.st_mtime, entry.name, _footprint(st)))
                except OSError:
                    continue  # removed meanwhile by another process
        found.sort()
        before = self._index
        self._index = OrderedDict((name, size) for _, name, size in found)
        self._bytes = sum(self._index.values())
        self._removed([name for name in before if name not in self._index])

    def _shrink(self, room: int) -> None:
        """Delete least recently used files until ``room`` more bytes fit under the limit."""
        removed = []
        while self._index and self._bytes + room > self.capacity_bytes:
            name, size = self._index.popitem(last=False)
            self._bytes -= size
            removed.append(name)
            try:
                os.unlink(self.root / name)
            except FileNotFoundError:
                pass
        self._removed(removed)

    def _removed(self, names: list[str]) -> None:
        """Tell the listener of files gone from the index (under the lock)."""
        if names and self.listener is not None:
            self.listener.values_removed(self.name, [name[: -len(SUFFIX)] for name in names])

    def has_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a file, without reading or touching it (a lookup asks before
        it reads, so that it reads nothing past a chain's first gap). Pure."""
        root = os.fspath(self.root)
        return [os.path.isfile(os.path.join(root, self.file_name(key))) for key in keys]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's file contents (None where absent or unreadable); a hit is touched, so
        it counts as recent here and after a restart. A hit whose touch fails (a read-only
        directory) is still a hit: only its recency is not recorded on disk."""
        out: list[bytes | None] = []
        root = os.fspath(self.root)  # plain strings: a lookup asks for every block's key
        for key in keys:
            name = self.file_name(key)
            path = os.path.join(root, name)
            try:
                with open(path, "rb", buffering=0) as file:
                    data = file.readall()
            except OSError:
                with self._lock:
                    size = self._index.pop(name, None)
                    self._bytes -= size or 0
                    self._removed([name] if size is not None else [])
                out.append(None)
                continue
            try:
                os.utime(path)
            except OSError:
                pass  # read-only to us: still a hit, its recency kept in this process only
            with self._lock:
                if name in self._index:
                    self._index.move_to_end(name)
            out.append(data)
        return out

    def put(self, key: str, value: bytes) -> bool:
        """Write a value atomically, deleting least recently used files first to stay under the
        limit. Returns False for a value larger than the whole tier. Raises OSError (a full
        disk, say); a failed write leaves no file behind."""
        name = self.file_name(key)
        with self._lock:
            self._writes += 1
            if not self.root.is_dir():
                # Deleted under us (a cleanup, an operator): make it again, with a fresh index
                # (its files went with it), rather than lose the tier until a restart.
                self.root.mkdir(parents=True, exist_ok=True)
                self._rescan()
            elif self._writes % RESCAN_EVERY == 0:
                self._rescan()
            old = self._index.pop(name, None)
            self._bytes -= old or 0
            if len(value) > self.capacity_bytes:
                self._removed([name] if old is not None else [])  # its old file is unindexed
                return False
            self._shrink(len(value) + 4096)  # the file's blocks may exceed its length
            tmp = self.root / f"{_TMP}{os.getpid()}-{threading.get_ident()}-{name}"
            try:
                with open(tmp, "wb") as f:
                    f.write(value)
                os.replace(tmp, self.root / name)
                size = _footprint(os.stat(self.root / name))
            finally:
                tmp.unlink(missing_ok=True)
            self._index[name] = size
            self._bytes += size
            if self.listener is not None:
                self.listener.value_stored(self.name, self.file_name(key)[: -len(SUFFIX)], value)
            self._shrink(0)
            return True

    def discard(self, key: str) -> None:
        """Delete a value's file (one that failed its checks: it would fail again)."""
        name = self.file_name(key)
        with self._lock:
            size = self._index.pop(name, None)
            self._bytes -= size or 0
            self._removed([name] if size is not None else [])
        (self.root / name).unlink(missing_ok=True)

    def close(self) -> None:
        """Nothing to release: every write is already whole on disk."""
