"""Many clients at once: 64 concurrent streams each get their own complete greedy answer, and a
client that disconnects mid-stream has its request aborted and its blocks freed."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from kvcache import LLM, SamplingParams
from tests.serve.conftest import LiveServer

NUM_CLIENTS = 64
MAX_TOKENS = 16
DEADLINE_S = 120.0


def wait_idle(server: LiveServer, timeout: float = 10.0) -> None:
    """Until the server's engine runs nothing (what an abort must lead to)."""
    deadline = time.monotonic() + timeout
    while server.state.engine.live() or server.state.llm.has_unfinished():
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.02)


def test_64_concurrent_streams_get_their_own_answers(
    server: LiveServer, reference_llm: LLM
) -> None:
    prompts = [f"client {i} asks about block {i % 7}: " for i in range(NUM_CLIENTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    expected = [o.text for o in reference_llm.generate(prompts, params)]

    async def one(api: openai.AsyncOpenAI, prompt: str) -> str:
        text = ""
        stream = await api.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def everyone() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        try:
            tasks = [one(api, p) for p in prompts]
            return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
        finally:
            await api.close()

    steps_before = server.state.llm.scheduler.step_count
    assert asyncio.run(everyone()) == expected
    # Batched continuously: far fewer steps than one request at a time would take.
    assert server.state.llm.scheduler.step_count - steps_before < NUM_CLIENTS * MAX_TOKENS / 4
    wait_idle(server)
    server.state.llm.block_manager.check_integrity()


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: LiveServer) -> None:
    llm = server.state.llm
    body = {"model": "tiny", "prompt": "a long answer " * 4, "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    for _ in range(3):
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few chunks in, the client goes away
            assert any(line.startswith("data: {") for line in got)
            assert llm.stats()["blocks_in_use"] > 0
    wait_idle(server)
    assert llm.stats()["blocks_in_use"] == 0
    llm.block_manager.check_integrity()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'kvcache_requests_total{finish_reason="abort"} 3.0' in metrics
