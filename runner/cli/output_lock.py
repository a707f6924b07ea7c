"""`kvcache generate -o OUTPUT`: the output file held by one run at a time.

Two runs appending to one file would each write every record (the file holds each twice, and
neither --resume nor a reader can tell which run wrote what). The run that opens OUTPUT first
takes an exclusive advisory lock on it (flock) before its model loads and holds it to the end;
a second run is refused at once, naming the file. The lock is on the file, not its name: when a
rewrite swaps a new file in (--resume cutting a torn tail), the lock moves to the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from types import TracebackType


class OutputInUse(ValueError):
    """Another process holds OUTPUT's lock: another run is writing it."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"{path} is being written by another kvcache generate run (it holds the file's "
            "lock): wait for that run to end, or pick another -o"
        )


class LockedOutput:
    """OUTPUT opened for appending (created when missing, never emptied here) and locked.
    Raises OutputInUse when another run holds it, OSError when it cannot be opened.

    A file this lock created is removed again on close unless a writer took it (`taken`): a
    run refused before it began (a usage error, a model that fails to load) leaves nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.taken = False  # set by the writer that appends the records
        self.fd, self.created = _open_locked(path)

    def follow(self) -> None:
        """After a rewrite replaced the file at `path` (a new inode): lock the new one, then let
        the old one go, so no other run can start on it meanwhile."""
        now = os.stat(self.path)
        held = os.fstat(self.fd)
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return
        fd, _ = _open_locked(self.path)
        os.close(self.fd)
        self.fd = fd

    def close(self) -> None:
        if self.created and not self.taken and os.fstat(self.fd).st_size == 0:
            with contextlib.suppress(OSError):  # gone already: nothing to clean up
                self.path.unlink()
        os.close(self.fd)  # closing the last descriptor of the open file releases the lock

    def __enter__(self) -> LockedOutput:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def _open_locked(path: Path) -> tuple[int, bool]:
    """`path` opened for appending and locked: (descriptor, whether this open created it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o666)
        created = True
    except FileExistsError:  # through a symlink too: O_EXCL refuses any existing name
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        created = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        os.close(fd)
        raise OutputInUse(path) from err
    except BaseException:
        os.close(fd)
        raise
    return fd, created
