"""A replica that dies under `kvcache router` (issue 42): a stream it was answering ends with an
OpenAI error event and `[DONE]` (the openai client raises), not a silent cut; a whole answer cut
short is a 502 in OpenAI's shape; and a replica found down forgets what the router's prefix index
believed it held, so after a restart (an empty cache) requests are balanced again instead of
all following the old prefixes there."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from kvcache import LLM
from runner.router.app import build_router_app
from runner.router.proxy import RouterSettings
from runner.serve.app import ServeSettings, build_app
from tests.redis_server import free_port
from tests.serve.conftest import LiveServer, router_stats

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "A replica may die while it answers this prompt, which is long enough for blocks. " * 2


@contextmanager
def router(urls: list[str], **settings: Any) -> Iterator[LiveServer]:
    with LiveServer(build_router_app(urls, RouterSettings(**settings))) as server:
        yield server


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextmanager
def replica_process(model_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`kvcache serve` as its own process, so that it can be killed outright."""
    port = free_port()
    args = [sys.executable, "-c", "import cli; cli.main()", "serve", "--model", str(model_dir)]
    args += ["--port", str(port), "--num-kv-blocks", "256", "--served-model-name", "tiny"]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        return False

    try:
        wait_for(up, "the replica did not start", 120)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def test_a_stream_cut_by_a_dying_replica_ends_with_an_error(tiny_llama_tok_dir: Path) -> None:
    with replica_process(tiny_llama_tok_dir) as (process, url):
        # Health checks too rare to notice the death: the failed stream itself must.
        with router([url], health_interval_s=60) as front:
            client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="-", max_retries=0)
            stream = client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=2000,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            texts = []
            with pytest.raises(openai.APIError, match="the replica died mid-stream"):
                for chunk in stream:
                    texts.append(chunk.choices[0].text)
                    if len(texts) == 3:
                        os.kill(process.pid, signal.SIGKILL)
            assert 3 <= len(texts) < 2000
            (replica,) = router_stats(front)
            assert not replica["healthy"] and replica["in_flight"] == 0
            assert replica["indexed_blocks"] == 0  # it died: its cache is gone, so is its index
            # With no replica left, a request is refused in OpenAI's shape.
            reply = httpx.post(f"{front.url}/v1/completions", json={"prompt": "a"}, timeout=30)
            assert (
                reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
            )


def dying_replica() -> FastAPI:
    """A replica process's HTTP side that dies in the middle of a whole (not streamed)
    answer's body: uvicorn drops the connection when the body fails, as it does when the
    process is killed between two writes."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b'{"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "half an'
            raise ConnectionAbortedError("the replica dies mid-answer")

        return StreamingResponse(body(), media_type="application/json")

    return app


def test_a_whole_answer_cut_short_is_a_502() -> None:
    replica = LiveServer(dying_replica()).start()
    try:
        with router([replica.url], policy="round_robin", health_interval_s=60) as front:
            reply = httpx.post(f"{front.url}/v1/completions", json={"prompt": "a"}, timeout=30)
            assert reply.status_code == 502, reply.text
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "server_error"
            assert "the replica died before its answer ended" in error["message"]
            assert router_stats(front)[0]["healthy"] is False
    finally:
        replica.stop()


class PortServer(LiveServer):
    """A LiveServer on a port of the test's choosing: a replica restarted where it was."""

    def __init__(self, app: Any, port: int) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})


def test_a_restarted_replica_is_not_sent_its_old_prefixes(tiny_llama_tok_dir: Path) -> None:
    def replica(port: int) -> PortServer:
        llm = LLM(str(tiny_llama_tok_dir), num_kv_blocks=128)  # a new process: an empty cache
        server = PortServer(build_app(llm, ServeSettings("tiny")), port)
        server.start()
        return server

    port = free_port()
    a, b = replica(port), replica(free_port())
    try:
        with router([a.url, b.url], health_interval_s=0.1) as front:
            client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="-", max_retries=0)

            def ask(turn: int) -> None:
                prompt = f"{PROMPT} turn {turn}?"
                client.completions.create(model="tiny", prompt=prompt, max_tokens=2)

            for turn in range(2):  # the conversation settles on A, which holds its prefix
                ask(turn)
            assert [r["sent"] for r in router_stats(front)] == [2, 0]
            assert router_stats(front)[0]["indexed_blocks"] > 0
            a.stop()
            wait_for(lambda: not router_stats(front)[0]["healthy"], "A is still up")
            a = replica(port)  # restarted, with nothing cached
            wait_for(lambda: router_stats(front)[0]["healthy"], "A did not come back")
            assert router_stats(front)[0]["indexed_blocks"] == 0
            for turn in range(2, 6):
                ask(turn)
            sent = [r["sent"] for r in router_stats(front)]
            assert sent[1] > 0, f"every request went back to the restarted replica: {sent}"
    finally:
        a.stop()
        b.stop()
