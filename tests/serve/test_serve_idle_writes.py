"""An idle server writes the blocks that wait for room in the tiers' write queue: its engine
thread queues them as room frees. Before, they waited for the next request's commit, which an
idle server never makes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from kvcache import LLM
from tests.serve.conftest import ServeFactory
from tests.tiers.test_idle_writes import ONE_STEP, PROMPT, cached_from_disk


def test_an_idle_server_writes_them(
    serve: ServeFactory, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model, disk = str(tiny_llama_dir), str(tmp_path / "disk")
    writer = LLM(model, disk_cache_dir=disk, **ONE_STEP)
    with serve(llm=writer, model_name="tiny") as server:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # nothing else is sent: the server is idle
            stats = writer.stats()["cache_tiers"]
            written = stats["tiers"]["disk"]["written_blocks"]
            if stats["waiting_writes"] == 0 and written >= len(PROMPT):
                break
            time.sleep(0.1)
        assert (stats["waiting_writes"], written >= len(PROMPT)) == (0, True), stats
    assert cached_from_disk(model, disk) == len(PROMPT) - 1
