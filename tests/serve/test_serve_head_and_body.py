"""A request head that does not arrive within `--head-timeout` gets a 408 naming the bound and
its connection closed (before, a client sending a header a minute held its connection for
ever), on a fresh connection and on a kept one; a body past `--max-body-bytes` gets a 413
naming the bound, announced or chunked (before, any size was read whole)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from kvcache import LLM
from runner.serve.app import ServeSettings, build_app
from runner.serve.head_deadline import head_bounded_protocol
from tests.serve.conftest import LiveServer, ServeFactory

HEAD_TIMEOUT_S = 0.5
BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
REQUEST = (
    "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(BODY)}\r\n\r\n"
).encode() + BODY


@pytest.fixture
def bounded(tiny_llm: LLM) -> Iterator[LiveServer]:
    app = build_app(tiny_llm, ServeSettings("tiny"))
    live = LiveServer(app, http=head_bounded_protocol(HEAD_TIMEOUT_S)).start()
    try:
        yield live
    finally:
        live.stop()


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_head_too_slow_is_408_and_closed(bounded: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(REQUEST[:30])  # a head begun, then a byte now and then
        for byte in REQUEST[30:36]:
            time.sleep(HEAD_TIMEOUT_S / 4)
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break  # closed already
        answer = read_all(sock)
        took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "within 0.5 s" in error["message"] and "--head-timeout" in error["message"]
    assert took < 5, took  # cut at the bound, not held


def test_a_kept_connection_bounds_its_next_head(bounded: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=10) as sock:
        sock.sendall(REQUEST)  # a whole request in time: served
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        while b'"usage"' not in first:
            first += sock.recv(65536)
        sock.sendall(REQUEST[:20])  # the next head never ends
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    headers = {"content-type": "application/json"}
    resp = httpx.post(f"{bounded.url}/v1/completions", content=BODY, headers=headers)
    assert resp.status_code == 200, resp.text


def test_a_body_past_the_bound_is_413(serve: ServeFactory) -> None:
    with serve(max_body_bytes=1_000) as server:
        url = f"{server.url}/v1/completions"
        big = json.dumps({"model": "tiny", "prompt": "x" * 2_000, "max_tokens": 2}).encode()
        headers = {"content-type": "application/json"}
        resp = httpx.post(url, content=big, headers=headers, timeout=60)
        assert resp.status_code == 413, resp.text
        message = resp.json()["error"]["message"]
        assert f"is {len(big)} bytes" in message and "past 1000 bytes" in message, message
        assert "--max-body-bytes" in message

        def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
            for start in range(0, len(big), 256):
                yield big[start : start + 256]

        resp = httpx.post(url, content=chunks(), headers=headers, timeout=60)
        assert resp.status_code == 413, resp.text
        assert "past 1000 bytes" in resp.json()["error"]["message"]
        assert httpx.post(url, content=BODY, headers=headers, timeout=60).status_code == 200
