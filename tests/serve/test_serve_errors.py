"""What a server answers to bad or unlucky requests, in OpenAI's error shape: 400 naming the
field, 401 without the API key, 404 for another model, 429 with Retry-After past the queue's
bound, 500 for a request that fails (the server goes on), 503 while draining."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvcache import LLM
from tests.serve.conftest import LiveServer, ServeFactory


def post(server: LiveServer, body: Any, path: str = "/v1/completions", **kw: Any) -> Any:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kw)


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "hi", "echo": "maybe"}, "echo", "valid boolean"),
        ({"prompt": "hi", "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"prompt": "hi", "top_p": 0}, "top_p", "greater than 0"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"prompt": "hi", "min_tokens": 9, "max_tokens": 2}, "min_tokens", "max_tokens"),
        ({"prompt": "x" * 600}, "prompt", "context"),
        ({"prompt": "hi", "suffix": "!"}, "suffix", "not supported"),
        ({"prompt": "hi", "guided_choice": []}, "guided_choice", "non-empty list"),
        ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one"),
        ({}, "prompt", "required"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    server: LiveServer, body: dict[str, Any], param: str, words: str
) -> None:
    error = error_of(post(server, {"model": "tiny", **body}), 400)
    assert error["param"] == param
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_bad_json_bad_messages_and_unknown_model(server: LiveServer) -> None:
    resp = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert "JSON" in error_of(resp, 400)["message"]
    chat = {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}
    assert error_of(post(server, chat, "/v1/chat/completions"), 400)["param"] == "messages.0.role"
    assert error_of(post(server, {"model": "gpt-9", "prompt": "hi"}), 404)["param"] == "model"
    # The server is fine after all of that.
    assert post(server, {"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_api_key(serve: ServeFactory) -> None:
    with serve(api_key="sesame") as server:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert error_of(post(server, body), 401)["code"] == "invalid_api_key"
        wrong = {"authorization": "Bearer nope"}
        assert error_of(post(server, body, headers=wrong), 401)["code"] == "invalid_api_key"
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        assert api.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
        assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed


def test_past_the_queue_bound_is_429_with_retry_after(
    serve: ServeFactory, tiny_llama_tok_dir: Path
) -> None:
    one_at_a_time = LLM(str(tiny_llama_tok_dir), max_num_seqs=1)
    real_run = one_at_a_time.runner.run

    def slow_run(scheduled: list[Any]) -> Any:  # so the running request outlasts the test
        time.sleep(0.01)
        return real_run(scheduled)

    one_at_a_time.runner.run = slow_run  # type: ignore[method-assign]
    with serve(one_at_a_time, max_queued_requests=1) as server:
        long = {"model": "tiny", "prompt": "a", "max_tokens": 400, "ignore_eos": True}
        waiting: list[int] = []
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**long, "stream": True}, timeout=30
        ) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # it runs: the batch (of one) is full
            second = threading.Thread(
                target=lambda: waiting.append(post(server, {**long, "max_tokens": 3}).status_code)
            )
            second.start()
            deadline = time.monotonic() + 10
            while server.state.engine.queued() < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            refused = post(server, long)
            assert error_of(refused, 429)["type"] == "rate_limit_exceeded"
            assert refused.headers["retry-after"] == "1"
        second.join(30)  # the stream's client left: the waiting one runs
        assert waiting == [200]


def test_a_failing_request_is_500_and_the_server_goes_on(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = server.state.llm.runner
    real_run = runner.run

    def run(scheduled: list[Any]) -> Any:
        if any("POISON" in (item.seq.prompt_text or "") for item in scheduled):
            raise RuntimeError("the device fell over")
        return real_run(scheduled)

    monkeypatch.setattr(runner, "run", run)
    error = error_of(post(server, {"model": "tiny", "prompt": "POISON", "max_tokens": 4}), 500)
    assert "the device fell over" in error["message"]
    body = {"model": "tiny", "prompt": "POISON", "max_tokens": 4, "stream": True}
    streamed = post(server, body).text
    assert "the device fell over" in streamed and streamed.endswith("data: [DONE]\n\n")
    fine = post(server, {"model": "tiny", "prompt": "fine", "max_tokens": 4})
    assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] == "length"
    server.state.llm.block_manager.check_integrity()


def test_draining_answers_503(server: LiveServer) -> None:
    server.state.draining = True
    assert error_of(post(server, {"model": "tiny", "prompt": "hi"}), 503)
    assert httpx.get(f"{server.url}/health").status_code == 503
