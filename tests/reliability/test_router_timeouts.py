"""A hung replica behind `kvcache router` (issue 42): its HTTP side answers /health, its engine
never answers. A request it holds past --upstream-first-output-timeout is retried on another
replica, and the hung one is out of rotation until its health check passes again; a stream that
goes silent past --upstream-idle-timeout ends with an OpenAI error event. Bounded to seconds:
the timeouts are 1 s, the clients' own 15 s."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvcache import LLM
from runner.router.app import build_router_app
from runner.router.proxy import RouterSettings
from runner.serve.app import ServeSettings, build_app
from tests.serve.conftest import LiveServer, router_stats

CLIENT_TIMEOUT_S = 15.0
HEALTHY = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n"
    b'{"status":"ok"}'
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunked_event(payload: dict[str, Any]) -> bytes:
    data = f"data: {json.dumps(payload)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class HungReplica:
    """A real socket on 127.0.0.1 that accepts every connection and answers GET /health (its
    HTTP side lives) but never a completion (its engine hung): POST /v1/completions gets
    nothing, POST /v1/chat/completions a stream's first two events and then nothing."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stopped = threading.Event()
        self.threads: list[threading.Thread] = []
        self.accepting = threading.Thread(target=self._accept)
        self.accepting.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.05)
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,))
            thread.start()
            self.threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.05)
            data = b""
            while not self.stopped.is_set():  # one request after another (keep-alive)
                if b"\r\n\r\n" not in data:
                    try:
                        received = conn.recv(65536)
                    except TimeoutError:
                        continue
                    if not received:
                        return
                    data += received
                    continue
                head, _, data = data.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                while len(data) < length and not self.stopped.is_set():
                    try:
                        data += conn.recv(65536)
                    except TimeoutError:
                        continue
                data = data[length:]
                if head.startswith(b"GET /health "):
                    conn.sendall(HEALTHY)
                elif head.startswith(b"POST /v1/chat/completions "):
                    role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
                    text = {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}
                    conn.sendall(STREAM_HEAD + chunked_event(role) + chunked_event(text))
                    self.stopped.wait()  # hung mid-stream
                elif head.startswith(b"POST "):
                    self.stopped.wait()  # hung before answering
                else:
                    conn.sendall(NOT_FOUND)

    def stop(self) -> None:
        self.stopped.set()
        self.accepting.join(5)
        for thread in self.threads:
            thread.join(5)
        self.sock.close()


@contextmanager
def hung_replica() -> Iterator[HungReplica]:
    replica = HungReplica()
    try:
        yield replica
    finally:
        replica.stop()


@contextmanager
def router(urls: list[str]) -> Iterator[LiveServer]:
    # Health checks too rare to matter: the timeouts alone must take the hung replica out.
    settings = RouterSettings(policy="least_loaded", health_interval_s=60)
    settings.first_output_timeout_s = settings.idle_timeout_s = 1.0
    with LiveServer(build_router_app(urls, settings)) as server:
        yield server


def test_a_hung_replica_is_taken_out_and_its_request_retried(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir), num_kv_blocks=64)
    working = LiveServer(build_app(llm, ServeSettings("tiny"))).start()
    try:
        with hung_replica() as hung, router([hung.url, working.url]) as front:
            body = {"model": "tiny", "prompt": "a question", "max_tokens": 4}
            url = f"{front.url}/v1/completions"
            reply = httpx.post(url, json=body, timeout=CLIENT_TIMEOUT_S)  # the hung one first
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
            assert [r["sent"] for r in router_stats(front)] == [1, 1]  # then retried
            assert [r["healthy"] for r in router_stats(front)] == [False, True]
            reply = httpx.post(url, json=body, timeout=CLIENT_TIMEOUT_S)
            assert reply.status_code == 200
            assert [r["sent"] for r in router_stats(front)] == [1, 2]  # straight to the other
            assert "kvcache_router_retries_total 1.0" in httpx.get(f"{front.url}/metrics").text
    finally:
        working.stop()


def test_a_stream_that_goes_silent_ends_with_an_error() -> None:
    with hung_replica() as hung, router([hung.url]) as front:
        client = openai.OpenAI(
            base_url=f"{front.url}/v1", api_key="-", max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        messages: Any = [{"role": "user", "content": "hi"}]
        stream = client.chat.completions.create(model="tiny", messages=messages, stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="went silent.*--upstream-idle-timeout"):
            for chunk in stream:
                texts.append(chunk.choices[0].delta.content)
        assert texts == [None, "Hel"]  # what it sent came through, then the error
        (replica,) = router_stats(front)
        assert not replica["healthy"] and replica["in_flight"] == 0
