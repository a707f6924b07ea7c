"""One lock over an engine's state, so that several threads can share one `LLM`.

The scheduler's queues, the block manager, the live requests and the output router change
together in every add, abort and step; a step run by one thread while another adds or steps
would corrupt them (a block committed for a request another step freed, K/V written twice).
Every entry point that reads or changes that state runs under the engine's one re-entrant lock,
held for a whole step: concurrent `generate` calls and streams then take turns step by step and
share each step's batch (requests/request_table.py hands each caller its own outputs), rather
than one call waiting for another's to end.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
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
