"""A client that leaves: its requests are aborted whether it streamed or waited for the whole
answer (the engine sends the waiting call an event every step, so a check that ran only
after a quiet 0.25 s never ran), and /metrics then shows the engine as it is (nothing
running, nothing waiting), not as it was at the last step."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcache import LLM
from tests.serve.conftest import LiveServer, ServeFactory

STEP_S = 0.05  # per step: the request would run 400 steps (20 s) if nobody stopped it
ABORT_WITHIN_S = 5.0
LONG = {"model": "tiny", "prompt": "a", "max_tokens": 400, "ignore_eos": True}


@pytest.fixture
def slow_llm(tiny_llama_tok_dir: Path) -> LLM:
    llm = LLM(str(tiny_llama_tok_dir), num_kv_blocks=64)
    real_run = llm.runner.run

    def slow_run(scheduled: list[Any]) -> Any:  # so the request outlasts its client
        time.sleep(STEP_S)
        return real_run(scheduled)

    llm.runner.run = slow_run  # type: ignore[method-assign]
    return llm


def wait_until_running(server: LiveServer) -> None:
    deadline = time.monotonic() + 10
    while not server.state.llm.has_unfinished():
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    time.sleep(3 * STEP_S)  # a few steps: its events keep the call's queue busy


def assert_aborted(server: LiveServer) -> None:
    """Within ABORT_WITHIN_S the engine holds nothing: no request, every block free."""
    llm = server.state.llm
    deadline = time.monotonic() + ABORT_WITHIN_S
    while llm.has_unfinished() or server.state.engine.live():
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.02)
    with llm.lock:
        assert not llm.scheduler.running and not llm.scheduler.waiting
        bm = llm.block_manager
        assert bm.num_available_blocks() == bm.num_blocks
        bm.check_integrity()


@pytest.fixture
def raw_post(serve: ServeFactory, slow_llm: LLM) -> Iterator[tuple[LiveServer, socket.socket]]:
    with serve(slow_llm) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        yield server, sock
        sock.close()


def send_json(sock: socket.socket, path: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_waiting_client_that_leaves_has_its_request_aborted(
    raw_post: tuple[LiveServer, socket.socket], path: str
) -> None:
    server, sock = raw_post
    body: dict[str, Any] = dict(LONG)
    if path.endswith("chat/completions"):
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": "a"}]
    send_json(sock, path, body)
    wait_until_running(server)
    sock.close()  # the client gives up (curl -m)
    assert_aborted(server)


def test_gauges_show_the_engine_after_the_last_abort(raw_post: tuple[LiveServer, Any]) -> None:
    server, sock = raw_post
    send_json(sock, "/v1/completions", {**LONG, "stream": True})
    wait_until_running(server)
    running = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert "kvcache_requests_running 1.0" in running
    sock.close()
    assert_aborted(server)  # streamed: aborted as before
    deadline = time.monotonic() + ABORT_WITHIN_S
    while True:  # the gauges are set on the engine's thread right after the abort
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        if "kvcache_requests_running 0.0" in metrics or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert "kvcache_requests_running 0.0" in metrics
    assert "kvcache_requests_waiting 0.0" in metrics
    assert "kvcache_kv_blocks_in_use 0.0" in metrics
