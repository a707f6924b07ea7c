"""A bound on the time a request's body takes to arrive. uvicorn bounds the idle time between
requests (`timeout_keep_alive`), not a body sent a byte at a time: without a bound, a few
slow clients hold connections and handlers open for ever. From the moment the app gets the
request's head, its body must be in within `timeout_s`; a handler still waiting for it then
gets an HTTPException 408 (the app's handler answers in OpenAI's error shape) with
`Connection: close`, so uvicorn drops the connection after the answer.

Once the last part of the body is in, receive() is passed through unbounded: a call that
waits for the client's disconnect (runner/serve/calls.py) waits as long as the answer takes.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyDeadline:
    """ASGI middleware: a request body not received within `timeout_s` is a 408."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_in = False

        async def bounded_receive() -> Message:
            nonlocal body_in
            if body_in:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                detail = (
                    f"the request body did not arrive within {self.timeout_s:g} s "
                    "(the server's bound, --body-timeout)"
                )
                raise HTTPException(408, detail, headers={"connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_in = True
            return message

        await self.app(scope, bounded_receive, send)
