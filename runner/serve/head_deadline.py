"""A bound on the time a request's head (its request line and headers) takes to arrive.
uvicorn closes a connection idle between requests (`timeout_keep_alive`), but once a byte of
a head has come, or on a fresh connection, it waits for the rest for ever: a client sending
a header a minute holds a connection, and enough of them hold them all. The ASGI app only
sees a request once its head is in, so the bound lives in the HTTP protocol: h11's, as
uvicorn runs it, with a timer armed when a connection opens and after each response, and
disarmed when a head is complete. When it fires first, the client gets a 408 naming the
bound and the connection is closed."""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from runner.serve.responses import error_body

HEAD_TIMEOUT_S = 10.0  # --head-timeout


def head_bounded_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the head bound `timeout_s` (for uvicorn.Config's `http`)."""

    class HeadBoundedProtocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in
                self._disarm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()  # the next request's head, on a kept connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self.head_timer = self.loop.call_later(timeout_s, self._head_too_slow)

        def _disarm_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_too_slow(self) -> None:
            self.head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            message = (
                f"the request head did not arrive within {timeout_s:g} s (the server's bound, "
                "--head-timeout)"
            )
            body = json.dumps(error_body(message, "invalid_request_error")).encode()
            head = (
                "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            ).encode()
            self.transport.write(head + body)
            self.transport.close()

    return HeadBoundedProtocol
