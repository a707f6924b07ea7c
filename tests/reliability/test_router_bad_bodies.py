"""Bodies `kvcache router` could not read (issue 42): JSON nested past Python's parser and a
`cache_salt` holding a lone surrogate were a plain-text 500; every bad body is now a 400 in
OpenAI's error shape naming the problem, on both routers, and the router's other errors are
in that shape too. A chat request carrying its own template is routed without the router
rendering it (the template is client code: a loop in it would hold a router thread)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcache import LLM
from runner.router.app import build_router_app
from runner.router.pd import build_pd_router_app
from runner.router.proxy import RouterSettings
from runner.serve.app import ServeSettings, build_app
from tests.redis_server import free_port
from tests.serve.conftest import LiveServer

NESTED = b"[" * 100_000 + b"]" * 100_000
PROMPT = "A prompt long enough for the router to hash a few of its blocks. " * 2
BAD_BODIES = [
    (NESTED, None, "nests arrays or objects too deep"),
    (b'{"prompt": ' + NESTED + b"}", None, "nests arrays or objects too deep"),
    (
        b'{"model": "tiny", "prompt": "' + PROMPT.encode() + b'", "cache_salt": "a\\ud800"}',
        "cache_salt",
        r"cache_salt is not Unicode text: it holds a lone surrogate (\ud800) at 1",
    ),
    (b'{"prompt": "a", "cache_salt": 7}', "cache_salt", "cache_salt must be a string, got int"),
    (b"[1, 2]", None, "the body must be a JSON object, got list"),
    (b'{"prompt": "\xff"}', None, "the body is not valid JSON"),
    (b'{"prompt": ', None, "the body is not valid JSON"),
]
BAD_BODY_IDS = ["nested", "nested-field", "surrogate-salt", "int-salt", "list", "not-utf8", "cut"]


def assert_openai_error(reply: httpx.Response, status: int, param: str | None, text: str) -> None:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert text in error["message"]
    assert "Traceback" not in reply.text


@pytest.fixture(scope="module")
def front(tiny_llama_tok_dir: Path) -> Iterator[LiveServer]:
    """A cache-aware router (it tokenizes and hashes prompts) over one real replica."""
    replica = LiveServer(build_app(LLM(str(tiny_llama_tok_dir)), ServeSettings("tiny"))).start()
    settings = RouterSettings(health_interval_s=0.1)
    router = LiveServer(build_router_app([replica.url], settings)).start()
    try:
        yield router
    finally:
        router.stop()
        replica.stop()


@pytest.mark.parametrize(("raw", "param", "text"), BAD_BODIES, ids=BAD_BODY_IDS)
def test_a_bad_body_is_a_400_naming_the_problem(
    front: LiveServer, raw: bytes, param: str | None, text: str
) -> None:
    headers = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        reply = httpx.post(f"{front.url}{path}", content=raw, headers=headers, timeout=30)
        assert_openai_error(reply, 400, param, text)
    # One bad request fails only itself.
    body: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "cache_salt": "s"}
    assert httpx.post(f"{front.url}/v1/completions", json=body, timeout=30).status_code == 200


def test_the_routers_other_errors_are_in_openais_shape(front: LiveServer) -> None:
    assert_openai_error(httpx.get(f"{front.url}/v1/nothing-here"), 404, None, "Not Found")
    assert_openai_error(httpx.get(f"{front.url}/v1/completions"), 405, None, "Not Allowed")


def test_the_disaggregated_router_refuses_bad_bodies_alike() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # the body is refused before any worker is asked
    router = LiveServer(build_pd_router_app([dead], [dead], RouterSettings())).start()
    try:
        for raw, param, text in BAD_BODIES[:3]:
            reply = httpx.post(f"{router.url}/v1/completions", content=raw, timeout=30)
            assert_openai_error(reply, 400, param, text)
    finally:
        router.stop()


def test_a_clients_own_chat_template_is_not_rendered_by_the_router(front: LiveServer) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    body["messages"] = [{"role": "user", "content": PROMPT}]
    url = f"{front.url}/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=30).status_code == 200
    indexed = httpx.get(f"{front.url}/router/stats").json()["replicas"][0]["indexed_blocks"]
    assert indexed > 0  # the server's own template: rendered and hashed
    other = [{"role": "user", "content": PROMPT[::-1]}]
    own = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    httpx.post(url, json=body | {"messages": other, "chat_template_kwargs": own}, timeout=30)
    stats = httpx.get(f"{front.url}/router/stats").json()
    assert stats["replicas"][0]["indexed_blocks"] == indexed  # routed by load, not hashed
