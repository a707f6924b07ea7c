"""A bound on a request body's size: without one, any client could send a body of any size,
held whole in memory before a handler saw it. A body whose Content-Length is past
`max_bytes` is a 413 before any of it is read; one sent without a length (chunked) is a 413
once what arrived passes the bound. Either way the answer carries `Connection: close`, so
uvicorn drops the connection and the rest of the body with it."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.serve.responses import error_body

MAX_BODY_BYTES = 32 * 2**20  # --max-body-bytes: a 128k-token prompt as ids is about 1 MB


class BodyLimit:
    """ASGI middleware: a request body past `max_bytes` is a 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def message(self, size: int | None) -> str:
        told = f"is {size} bytes" if size is not None else "goes on"
        return (
            f"the request body {told}, past {self.max_bytes} bytes (the server's bound, "
            "--max-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _refuse(send, self.message(int(length)))
            return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    detail = self.message(None)
                    raise HTTPException(413, detail, headers={"connection": "close"})
            return message

        await self.app(scope, bounded_receive, send)


async def _refuse(send: Send, message: str) -> None:
    """A 413 in OpenAI's error shape, sent before the app (and its routes) see the request."""
    body = json.dumps(error_body(message, "invalid_request_error")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
