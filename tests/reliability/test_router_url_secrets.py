"""A replica URL with a password (`http://admin:s3cretpw@host:port`) behind `kvcache router`
(issue 51, item 4): /router/stats and /metrics answer without the router's --api-key, and
showed the URL as given. They show it as the tier and handover URLs are shown
(kvcache/redaction.py): `http://admin:***@host:port`; the router still sends the credentials."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvcache import LLM
from runner.router.app import build_router_app
from runner.router.pd import build_pd_router_app
from runner.router.proxy import RouterSettings
from runner.serve.app import ServeSettings, build_app
from tests.redis_server import free_port
from tests.serve.conftest import LiveServer

PASSWORD = "s3cretpw"


@pytest.fixture(scope="module")
def replica(tiny_llama_tok_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(build_app(LLM(str(tiny_llama_tok_dir)), ServeSettings("tiny"))) as server:
        yield server


def test_the_router_shows_no_replica_password(replica: LiveServer) -> None:
    url = f"http://admin:{PASSWORD}@127.0.0.1:{replica.port}"
    settings = RouterSettings(health_interval_s=0.2, api_key="router-key")
    router = LiveServer(build_router_app([url], settings)).start()
    try:
        body = {"model": "tiny", "prompt": "Hello there, replica.", "max_tokens": 2}
        headers = {"Authorization": "Bearer router-key"}
        reply = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert reply.status_code == 200, reply.text
        stats = httpx.get(f"{router.url}/router/stats", timeout=10)
        metrics = httpx.get(f"{router.url}/metrics", timeout=10)
        for page in (stats, metrics):
            assert page.status_code == 200  # open without the key, as documented
            assert PASSWORD not in page.text
        shown = f"http://admin:***@127.0.0.1:{replica.port}"
        assert stats.json()["replicas"][0]["url"] == shown
        assert f'replica="{shown}"' in metrics.text
    finally:
        router.stop()


def test_the_prefill_decode_router_shows_no_worker_password() -> None:
    prefill = f"http://p:{PASSWORD}@127.0.0.1:{free_port()}"
    decode = f"http://d:{PASSWORD}1@127.0.0.1:{free_port()}"
    router = LiveServer(build_pd_router_app([prefill], [decode], RouterSettings())).start()
    try:
        stats = httpx.get(f"{router.url}/router/stats", timeout=10)
        assert stats.status_code == 200 and PASSWORD not in stats.text
        assert stats.json()["prefill"][0]["url"].startswith("http://p:***@127.0.0.1:")
        assert stats.json()["decode"][0]["url"].startswith("http://d:***@127.0.0.1:")
    finally:
        router.stop()
