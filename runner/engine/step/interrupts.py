"""Ctrl-C held back while the engine's books are half-written.

An engine step's bookkeeping (admitting and freeing blocks, recording tokens, finishing
requests, handing their outputs over) changes several structures that must agree: a
KeyboardInterrupt between two of those changes could lose a finished request, leak a block or
leave a request that never ends. The model's forward pass, where a step spends nearly all its
time, stays interruptible at once; the bookkeeping around it runs to its end first.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Run the block with SIGINT held: one that arrives meanwhile is raised (as the handler in
    place before would have) once the block is done. Only the main thread receives signals in
    Python, so elsewhere the block simply runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        if previous is not None:  # None: a handler set outside Python, which stays in place
            signal.signal(signal.SIGINT, previous)
        if arrived:
            signal.raise_signal(signal.SIGINT)  # now through the handler the caller had
