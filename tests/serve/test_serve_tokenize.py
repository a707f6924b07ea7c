"""/tokenize and /detokenize under hostile input: a lone surrogate is a 400 naming the field
(it was the tokenizer's TypeError as a 500), a prompt of megabytes or millions of ids is
worked on the tokenizer's threads while /health goes on answering (the event loop waited
seconds on it), and the calls at once are bounded (a 429 naming the bound past it)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from runner.serve.calls import CallError
from runner.serve.tokenizing import TokenizerWork
from tests.serve.conftest import LiveServer

BIG_CHARS = 2_000_000  # the tiny byte-level tokenizer: ~3 s here, one token a byte
BIG_IDS = 4_000_000  # 16 MB of JSON: ~1.5 s to parse and decode here


def test_a_lone_surrogate_is_a_400_naming_the_field(server: LiveServer) -> None:
    raw = '{"model": "tiny", "prompt": "ab\\ud800cd"}'  # a valid JSON escape, not valid text
    resp = httpx.post(
        f"{server.url}/tokenize",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt", error
    assert "lone surrogate U+D800 at character 2" in error["message"], error
    ok = httpx.post(f"{server.url}/tokenize", json={"prompt": "abcd"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["count"] >= 4, ok.text


def slowest_health_while(server: LiveServer, call: threading.Thread) -> tuple[float, int]:
    """The slowest /health answer, and how many answered, while `call` runs."""
    slowest, answered = 0.0, 0
    with httpx.Client(timeout=60) as client:
        while call.is_alive():
            start = time.monotonic()
            assert client.get(f"{server.url}/health").status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            answered += 1
            time.sleep(0.05)
    return slowest, answered


@pytest.mark.parametrize("route", ["/tokenize", "/detokenize"])
def test_big_calls_leave_the_event_loop_free(server: LiveServer, route: str) -> None:
    """Before, /health waited the whole call, answered once; now it answers throughout."""
    body = (
        {"prompt": "hello world " * (BIG_CHARS // 12)}
        if route == "/tokenize"
        else {"tokens": [3 + i % 200 for i in range(BIG_IDS)]}
    )
    content = json.dumps(body).encode()  # encoded before: the server shares this process
    answers: list[httpx.Response] = []
    timing: list[float] = []

    def big() -> None:
        start = time.monotonic()
        answers.append(
            httpx.post(
                f"{server.url}{route}",
                content=content,
                headers={"content-type": "application/json"},
                timeout=120,
            )
        )
        timing.append(time.monotonic() - start)

    call = threading.Thread(target=big)
    call.start()
    time.sleep(0.2)  # the body is on its way: /health from here on
    slowest, answered = slowest_health_while(server, call)
    call.join()
    assert answers[0].status_code == 200, answers[0].text[:300]
    if route == "/tokenize":
        out = answers[0].json()
        assert out["count"] == len(out["tokens"]) > BIG_CHARS * 0.9  # about a token a byte
    else:
        assert len(answers[0].json()["prompt"]) > 0
    # A blocked loop answers /health once, when the call is done (1.5-1.7 s for /tokenize
    # and 0.9-1.4 s for /detokenize before); a free one every few tenths of a second.
    assert answered >= 3 and slowest < 1.0, (slowest, answered, timing)


def test_the_calls_at_once_are_bounded() -> None:
    """One thread and one waiting place: a third call at once is a 429 naming the bound, and
    the bound is free again once the first two are done."""

    async def scenario() -> list[object]:
        work = TokenizerWork(threads=1, waiting=1)
        release = threading.Event()
        try:
            first = asyncio.ensure_future(work.run(lambda: release.wait(30)))
            second = asyncio.ensure_future(work.run(lambda: "second"))
            await asyncio.sleep(0.05)
            with pytest.raises(CallError) as refused:
                await work.run(lambda: "third")
            release.set()
            done = [await first, await second, await work.run(lambda: "fourth")]
            return [refused.value.status, refused.value.body["error"]["message"], *done]
        finally:
            release.set()
            work.close()

    status, message, *done = asyncio.run(scenario())
    assert status == 429
    assert "1 calls run and 1 wait" in str(message)
    assert done == [True, "second", "fourth"]


def test_a_bad_detokenize_body_is_a_400_naming_the_field(server: LiveServer) -> None:
    """The body is parsed on a tokenizer thread now: its errors are the 400s FastAPI gave."""
    url = f"{server.url}/detokenize"
    wrong = httpx.post(url, json={"tokens": [1, "a"]}, timeout=60)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "tokens.1", wrong.text
    broken = httpx.post(url, content=b"{", headers={"content-type": "application/json"})
    assert broken.status_code == 400, broken.text
    assert "not valid JSON" in broken.json()["error"]["message"]
    assert httpx.post(url, json={"tokens": [5, 6]}, timeout=60).status_code == 200
