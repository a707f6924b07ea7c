"""What keeps an engine's books whole: one lock over its state, and Ctrl-C held back while the
books are half-written.

The lock: the scheduler's queues, the block manager, the live requests and the output router
change together in every add, abort and step; a step run by one thread while another adds or
steps would corrupt them (a block committed for a request another step freed, K/V written
twice). Every entry point that reads or changes that state runs under the engine's one
re-entrant lock, held for a whole step: concurrent `generate` calls and streams then take turns
step by step and share each step's batch (requests/request_table.py hands each caller its own
outputs), rather than one call waiting for another's to end.

Interrupts: an engine step's bookkeeping (admitting and freeing blocks, recording tokens,
finishing requests, handing their outputs over) changes several structures that must agree: a
KeyboardInterrupt between two of those changes could lose a finished request, leak a block or
leave a request that never ends. The model's forward pass, where a step spends nearly all its
time, stays interruptible at once; the bookkeeping around it runs to its end first.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class HasLock(Protocol):
    lock: threading.RLock


S = TypeVar("S", bound=HasLock)


def locked(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run `method` with its instance's `lock` held."""

    @functools.wraps(method)
    def with_lock(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)

    return with_lock


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
