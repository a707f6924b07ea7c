"""Chat templates in `kvcache serve`: a client's own template (chat_template_kwargs'
chat_template) is refused unless the server trusts them (--trust-request-chat-template, as
vLLM's), and every render, the server's template too, is bounded in time and in the size of
what it builds; past a bound the request is a 400 naming it, and the server goes on."""

from __future__ import annotations

from typing import Any

import httpx

from runner.serve.templates import RenderBounds
from tests.serve.conftest import LiveServer, ServeFactory

MESSAGES = [{"role": "user", "content": "hi"}]
NESTED = "{% for i in range(90000) %}{% for j in range(90000) %}{% endfor %}{% endfor %}"
DOUBLING = (
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}"
)
BOUNDS = RenderBounds(time_s=0.5, max_chars=100_000)


def chat(server: LiveServer, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_a_clients_template_is_refused_by_default(server: LiveServer) -> None:
    resp = chat(server, chat_template_kwargs={"chat_template": "{{ messages[0].content }}"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "chat_template_kwargs.chat_template"
    assert "--trust-request-chat-template" in error["message"]
    ok = chat(server, chat_template_kwargs={"add_generation_prompt": False})  # other kwargs do
    assert ok.status_code == 200, ok.text


def test_renders_past_their_bounds_are_400s(serve: ServeFactory) -> None:
    with serve(trust_request_chat_template=True, template_bounds=BOUNDS) as server:
        own = chat(server, chat_template_kwargs={"chat_template": "<{{ messages[0].content }}>"})
        assert own.status_code == 200, own.text
        assert own.json()["usage"]["prompt_tokens"] == len(
            server.state.llm.tokenizer("<hi>", add_special_tokens=False).input_ids
        )
        slow = chat(server, chat_template_kwargs={"chat_template": NESTED})
        assert slow.status_code == 400, slow.text
        assert "took over 0.5 s" in slow.json()["error"]["message"]
        assert slow.json()["error"]["param"] == "chat_template_kwargs.chat_template"
        big = chat(server, chat_template_kwargs={"chat_template": DOUBLING})
        assert big.status_code == 400, big.text
        assert "went past 100000 characters" in big.json()["error"]["message"]
        # The server's own template is bounded too: a conversation it renders too long.
        long = [{"role": "user", "content": "x" * 60_000}] * 2
        body = {"model": "tiny", "messages": long, "max_tokens": 2}
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400 and "100000 characters" in resp.text, resp.text
        assert chat(server).status_code == 200  # and it goes on
