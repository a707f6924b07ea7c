"""Servers for the serve and router tests: real uvicorn servers on 127.0.0.1, each on a free
port of its own, started and stopped by the fixtures (in a thread of the test process, so a
test can look at the engine behind the HTTP: its integrity, its blocks)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from kvcache import LLM
from runner.serve.app import ServeSettings, build_app

START_TIMEOUT_S = 30.0


class LiveServer:
    """One uvicorn server running `app` in a thread, on a socket bound to a free port
    (`config`: uvicorn.Config's options over the defaults)."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        options = {"log_level": "warning", "timeout_graceful_shutdown": 5, **config}
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def state(self) -> Any:
        return self.app.state.serve


def router_stats(router: LiveServer) -> list[dict[str, Any]]:
    """A router's /router/stats: a dict for each replica (sent, in_flight, ...)."""
    stats: list[dict[str, Any]] = httpx.get(f"{router.url}/router/stats").json()["replicas"]
    return stats


@contextmanager
def replica_servers(llms: list[LLM]) -> Iterator[list[LiveServer]]:
    """A server named tiny over each engine, for a router to front; each stopped at the end
    unless the test stopped it already."""
    replicas = [LiveServer(build_app(llm, ServeSettings("tiny"))).start() for llm in llms]
    try:
        yield replicas
    finally:
        for replica in replicas:
            if replica.thread.is_alive():
                replica.stop()


ServeFactory = Callable[..., AbstractContextManager[LiveServer]]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_tok_dir: Path) -> LLM:
    """The tiny byte-level Llama behind the servers of a test module (one server at a time:
    a server's engine loop owns its engine)."""
    return LLM(str(tiny_llama_tok_dir), num_kv_blocks=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def reference_llm(tiny_llama_tok_dir: Path) -> LLM:
    """The same model, called directly: the answers a server must give."""
    return LLM(str(tiny_llama_tok_dir))


@pytest.fixture
def serve(tiny_llm: LLM) -> ServeFactory:
    """serve(llm=tiny_llm, **ServeSettings fields) -> context manager of a LiveServer."""

    @contextmanager
    def start(llm: LLM | None = None, **settings: Any) -> Iterator[LiveServer]:
        settings.setdefault("model_name", "tiny")
        with LiveServer(build_app(llm or tiny_llm, ServeSettings(**settings))) as server:
            yield server

    return start


@pytest.fixture
def server(serve: ServeFactory) -> Iterator[LiveServer]:
    with serve() as live:
        yield live
