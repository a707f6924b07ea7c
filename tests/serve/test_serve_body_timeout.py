"""A request body that does not arrive within the server's bound (`--body-timeout`) gets a
408 in OpenAI's error shape and its connection closed; a body that arrives in time, in
pieces, is served."""

from __future__ import annotations

import json
import socket
import time

from tests.serve.conftest import LiveServer, ServeFactory

BODY_TIMEOUT_S = 0.5


def head(length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (bounded by the socket timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def connect(server: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def test_a_body_too_slow_is_408_and_the_connection_closed(serve: ServeFactory) -> None:
    with serve(body_timeout_s=BODY_TIMEOUT_S) as server:
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        with connect(server) as sock:
            sock.sendall(head(len(body)) + body[:5])  # and the rest never comes
            answer = read_all(sock)  # ends: the server closed the connection
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), answer
        error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
        assert "did not arrive within 0.5 s" in error["message"]

        with connect(server) as sock:  # in pieces, but in time: served
            sock.sendall(head(len(body)) + body[:5])
            time.sleep(BODY_TIMEOUT_S / 5)
            sock.sendall(body[5:])
            status = sock.recv(65536).split(b"\r\n", 1)[0]
        assert status.startswith(b"HTTP/1.1 200"), status
