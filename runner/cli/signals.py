"""SIGTERM as Ctrl-C for the command line: `kill`, a container's stop and a job scheduler's
timeout send SIGTERM, whose default ends the process at once, without a message, the prefix
cache unsaved. Treated as SIGINT, it takes the same path: the step's bookkeeping finishes
(runner/engine/step/guards.py), the run says what it kept, and the cache is saved."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    """Within the block, SIGTERM does what SIGINT does; the handler before is put back after.
    Only the main thread receives signals in Python, so elsewhere the block simply runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _as_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _as_sigint(signum: int, frame: FrameType | None) -> None:
    """Run SIGINT's handler as it is now: KeyboardInterrupt, or held while interrupts are
    (runner/engine/step/guards.py). A process whose SIGINT is ignored (started in the
    background by a shell) still stops on SIGTERM."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt
