"""A cache-aware `kvcache router` beside a replica whose /kvcache/info lacks a fingerprint or a
block size, gives `block_size: 0` or is not a JSON object (issue 51, item 5): before, every
request was a 500 (KeyError / ValueError in the policy's choice), though the other replica was
fine. That replica now counts as holding no known prefix; the requests are answered, and the
good replica's prefixes still draw its requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvcache import LLM
from runner.router.app import build_router_app
from runner.router.proxy import RouterSettings
from runner.serve.app import ServeSettings, build_app
from tests.serve.conftest import LiveServer

PROMPT = "A conversation long enough to fill a good number of blocks of the cache. " * 6
BAD_INFOS: list[Any] = [
    {},
    {"fingerprint": "f00d", "model_path": "/nowhere"},
    {"block_size": 16},
    {"fingerprint": "f00d", "block_size": 0},
    [1, 2],
]
BAD_INFO_IDS = ["empty", "no-block-size", "no-fingerprint", "block-size-0", "a-list"]


def odd_replica(info: Any) -> FastAPI:
    """A replica that answers its health check and every completion, and `info` as its
    /kvcache/info."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/kvcache/info")
    async def kvcache_info() -> Any:
        return info

    @app.post("/v1/completions")
    async def completions() -> dict[str, Any]:
        choice = {"index": 0, "text": "odd", "finish_reason": "length", "logprobs": None}
        return {"id": "cmpl-odd", "object": "text_completion", "choices": [choice]}

    return app


@pytest.fixture(scope="module")
def replica(tiny_llama_tok_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(build_app(LLM(str(tiny_llama_tok_dir)), ServeSettings("tiny"))) as server:
        yield server


@pytest.mark.parametrize("odd_first", [False, True], ids=["good-first", "odd-first"])
@pytest.mark.parametrize("info", BAD_INFOS, ids=BAD_INFO_IDS)
def test_a_replica_with_unusable_info_holds_no_known_prefix(
    replica: LiveServer, info: Any, odd_first: bool
) -> None:
    odd = LiveServer(odd_replica(info)).start()
    urls = [odd.url, replica.url] if odd_first else [replica.url, odd.url]
    router = LiveServer(build_router_app(urls, RouterSettings(health_interval_s=0.2))).start()
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        codes = [
            httpx.post(f"{router.url}/v1/completions", json=body, timeout=30).status_code
            for _ in range(10)
        ]
        assert codes == [200] * 10
        stats = httpx.get(f"{router.url}/router/stats", timeout=10).json()
        # The good replica's prefix drew the repeats (its tokenizer found whichever came first).
        assert stats["reasons"].get("prefix_match", 0) >= 7, stats
        odd_stats = next(r for r in stats["replicas"] if r["url"] == odd.url)
        assert odd_stats["indexed_blocks"] == 0
    finally:
        router.stop()
        odd.stop()
