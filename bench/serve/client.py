"""The benchmark's client: sessions started at a Poisson rate (or all at once), at most
`max_concurrency` of them running, each turn a streaming chat completion (or a completion of
the conversation's transcript, on /v1/completions) timed on arrival of its chunks: TTFT at the
first chunk with text, each later one an inter-token gap, end to end at [DONE], and the time
per output token after the first (vLLM's TPOT); usage (with cached_tokens) from the final
chunk (stream_options.include_usage), or llama-server's `timings.cache_n` where its usage has
no cached_tokens. With an API key every request carries it as a bearer token."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import httpx

from bench.serve.workload import Session, as_prompt

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class Endpoint(NamedTuple):
    """Where the requests go: a server's base URL, the route (CHAT or COMPLETIONS) and the
    API key they carry, if any."""

    base_url: str
    path: str = CHAT
    api_key: str | None = None

    def url(self, path: str | None = None) -> str:
        return self.base_url.rstrip("/") + (path or self.path)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def chat(self) -> bool:
        return self.path == CHAT


@dataclass
class RequestResult:
    session: str
    turn: int
    start: float
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (vLLM's TPOT): None below two tokens."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


async def run_turn(
    client: httpx.AsyncClient, url: str, body: dict[str, object], result: RequestResult
) -> RequestResult:
    last = result.start
    reused: int | None = 0  # None once usage gave cached_tokens itself
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.ok = result.error is None
                    break
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens = int(usage["prompt_tokens"])
                    result.completion_tokens = int(usage["completion_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    if "cached_tokens" in details:
                        result.cached_tokens = int(details["cached_tokens"] or 0)
                        reused = None
                if reused is not None and isinstance(chunk.get("timings"), dict):
                    # llama-server: the prompt tokens its slot reused, where usage says none
                    reused = int(chunk["timings"].get("cache_n") or 0)
                    result.cached_tokens = reused
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content") or choice.get("text")
                    if content:
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - result.start
                        else:
                            result.itls.append(now - last)
                        last = now
                        result.text += content
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
    result.e2e = time.perf_counter() - result.start
    return result


async def run_session(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    model: str,
    session: Session,
    extra: Mapping[str, object],
) -> list[RequestResult]:
    """A session's turns in order, each one's answer (as received) in the next one's prompt."""
    messages = [dict(m) for m in session.opening]
    results = []
    url = endpoint.url()
    for turn in range(session.turns):
        prompt = {"messages": messages} if endpoint.chat else {"prompt": as_prompt(messages)}
        body = {
            "model": model,
            **prompt,
            "max_tokens": session.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        result = await run_turn(
            client, url, body, RequestResult(session.id, turn, time.perf_counter())
        )
        results.append(result)
        if not result.ok or turn == session.turns - 1:
            break
        messages = [
            *messages,
            {"role": "assistant", "content": result.text},
            {"role": "user", "content": session.follow_ups[turn]},
        ]
    return results


async def run_benchmark(
    endpoint: Endpoint,
    model: str,
    sessions: list[Session],
    max_concurrency: int,
    request_rate: float,
    seed: int,
    extra: Mapping[str, object],
) -> tuple[list[RequestResult], float]:
    """Every session's results, and the wall time the whole run took."""
    gate = asyncio.Semaphore(max_concurrency)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency + 8)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, headers=endpoint.headers
    ) as client:

        async def gated(session: Session) -> list[RequestResult]:
            async with gate:
                return await run_session(client, endpoint, model, session, extra)

        start = time.perf_counter()
        tasks = []
        for session in sessions:
            tasks.append(asyncio.create_task(gated(session)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return [r for results in done for r in results], duration
