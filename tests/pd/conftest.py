"""Prefill and decode workers for the disaggregation tests: real `kvcache serve` apps (the
tiny byte-level Llama) on free loopback ports, each with its role's routes, started and
stopped by the fixtures; Redis, where a test asks for it, is a real redis-server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvcache import LLM
from runner.disagg.roles import RoleOptions, RoleParts, build_role, engine_options_for
from runner.disagg.routes import attach_role
from runner.serve.app import ServeSettings, build_app
from tests.redis_server import redis_server  # noqa: F401 - the fixture, for the Redis tests
from tests.serve.conftest import LiveServer


class Worker(NamedTuple):
    server: LiveServer
    llm: LLM
    parts: RoleParts

    @property
    def url(self) -> str:
        return self.server.url


def start_worker(
    model_dir: Path, role: str, handover: str = "zmq", api_key: str | None = None, **engine: Any
) -> Worker:
    options = RoleOptions(role=role, handover=handover)
    engine = {"num_kv_blocks": 256, "max_num_seqs": 16} | engine
    llm = LLM(str(model_dir), **engine_options_for(options, engine))
    parts = build_role(llm, options)
    app = build_app(llm, ServeSettings("tiny", api_key=api_key))
    attach_role(app, parts)
    return Worker(LiveServer(app).start(), llm, parts)


def stop_worker(worker: Worker) -> None:
    if worker.server.thread.is_alive():
        worker.server.stop()
    worker.parts.close()


WorkerFactory = Callable[..., AbstractContextManager[Worker]]


@pytest.fixture
def worker(tiny_llama_tok_dir: Path) -> WorkerFactory:
    """worker(role, handover="zmq", api_key=None, **engine options) -> context manager of a
    Worker."""

    @contextmanager
    def start(
        role: str, handover: str = "zmq", api_key: str | None = None, **engine: Any
    ) -> Iterator[Worker]:
        live = start_worker(tiny_llama_tok_dir, role, handover, api_key, **engine)
        try:
            yield live
        finally:
            stop_worker(live)

    return start


@pytest.fixture(scope="module")
def reference_llm(tiny_llama_tok_dir: Path) -> LLM:
    """The colocated engine: the answers a disaggregated pair must give."""
    return LLM(str(tiny_llama_tok_dir))
