"""A request's structure (a JSON schema, a regex, a choice, a grammar, a forced tool call)
compiled before the request reaches the engine, on threads of the server's own: compiled on
the engine's thread, a choice of 8,000 strings stalled every other stream for 4.4-5.0 s, and a
50,000-entry enum 42 s. The request waits for its compile; the batch does not. The engine then
finds the grammar in its GrammarBook's cache (runner/sampling/structured_outputs.py).

The work is bounded (GrammarBounds): a structure longer than `max_chars` is a 400 before any
compile, and one whose compile takes over `time_s` is a 400 when that time is up (xgrammar's
compile cannot be stopped: its thread finishes it, and counts against the bound on the
calls at once until then). GRAMMAR_THREADS compile at once, MAX_WAITING more wait; a request
past that, or still waiting for a thread when its time is up, is a 429."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from runner.sampling.structured_outputs import StructuredOutputsParams
from runner.serve.calls import CallError

GRAMMAR_THREADS = 2
MAX_WAITING = 32  # compiles waiting for a thread, past those running


@dataclass(frozen=True)
class GrammarBounds:
    """How many characters one structure's text may hold (a schema as JSON, a choice as its
    grammar) and how long its compile may take."""

    time_s: float = 10.0
    max_chars: int = 100_000


class GrammarWork:
    """Compiles (and checks) structures with `check` (the engine's check_structured_outputs)
    on threads of its own, within `bounds`."""

    def __init__(
        self,
        check: Callable[[StructuredOutputsParams | None], None],
        bounds: GrammarBounds | None = None,
        threads: int = GRAMMAR_THREADS,
        waiting: int = MAX_WAITING,
    ) -> None:
        self._check = check
        self.bounds = bounds or GrammarBounds()
        self.threads, self.waiting = threads, waiting
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcache-grammar")
        self._held = 0  # compiles running or queued, ended or not; the event loop's alone

    async def check(self, spec: StructuredOutputsParams | None, param: str) -> None:
        """Compile and check `spec` (nothing for None) off the event loop and the engine's
        thread; CallError 400 naming `param` for a structure past a bound or one that does not
        compile, 429 when the compile threads are taken."""
        if spec is None:
            return
        bounds = self.bounds
        size = len(spec.key[1])
        if size > bounds.max_chars:
            message = (
                f"{param}: the structure is {size} characters long; the server compiles at "
                f"most {bounds.max_chars} (its bound on a structure's size)"
            )
            raise CallError(400, message, "invalid_request_error", param)
        if self._held >= self.threads + self.waiting:
            raise CallError(429, self._busy(), "rate_limit_exceeded")
        started = threading.Event()

        def work() -> None:
            started.set()
            self._check(spec)

        loop = asyncio.get_running_loop()
        self._held += 1
        future: Future[None] = self._pool.submit(work)
        # Released when the thread is done with it, which may be after this call has answered.
        future.add_done_callback(lambda _: _call_soon(loop, self._release))
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), bounds.time_s)
        except TimeoutError:
            if future.cancel() or not started.is_set():
                raise CallError(429, self._busy(), "rate_limit_exceeded") from None
            message = (
                f"{param}: compiling the structure took over {bounds.time_s:g} s (the server's "
                "bound on a structure's compile time)"
            )
            raise CallError(400, message, "invalid_request_error", param) from None
        except ValueError as err:
            raise CallError(400, str(err), "invalid_request_error", param) from err

    def _release(self) -> None:
        self._held -= 1

    def _busy(self) -> str:
        return (
            f"the structure compiler is busy: {self.threads} compiles run and {self.waiting} "
            "wait (the server's bound on structures compiled at once); retry later"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """`callback` on `loop`'s thread, unless the loop has closed (a compile that outlived its
    server: nothing is left to count)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass
