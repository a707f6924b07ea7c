"""The work of /tokenize and /detokenize, off the event loop: a 3.3 MB prompt took the
tokenizer 4-5.8 s, and 2M ids took 1.2 s to decode, while every stream and /health waited on
the loop. Each call runs on one of the server's tokenizer threads, its answer's JSON built
there too (3M ids make 20 MB of it); the tokenizer's own Rust code lets go of the
interpreter's lock, so the loop and the engine's thread go on meanwhile.

The work is bounded: TOKENIZE_THREADS calls run at once, and at most MAX_WAITING more wait
behind them; a call past that is a 429 naming the bound. A call whose client leaves while it
waits is dropped from the queue (asyncio cancels the pool's future)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi.responses import Response

from runner.serve.calls import CallError

TOKENIZE_THREADS = 2
MAX_WAITING = 32  # tokenizer calls waiting for a thread, past those running

T = TypeVar("T")


class TokenizerWork:
    """Runs tokenizer calls on threads of its own, at most `threads` at once and `waiting`
    more queued."""

    def __init__(self, threads: int = TOKENIZE_THREADS, waiting: int = MAX_WAITING) -> None:
        self.threads, self.waiting = threads, waiting
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcache-tokenize")
        self._held = 0  # calls running or queued; changed only on the event loop's thread

    async def run(self, work: Callable[[], T]) -> T:
        """`work()`'s result, computed on a tokenizer thread; a CallError 429 when the
        threads are busy and MAX_WAITING calls already wait."""
        if self._held >= self.threads + self.waiting:
            message = (
                f"the tokenizer is busy: {self.threads} calls run and {self.waiting} wait "
                "(the server's bound on /tokenize and /detokenize calls at once); retry later"
            )
            raise CallError(429, message, "rate_limit_exceeded")
        self._held += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)
        finally:
            self._held -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def json_response(answer: object) -> Response:
    """`answer` as JSONResponse would render it, built by the calling thread."""
    body = json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Response(body.encode("utf-8"), media_type="application/json")
