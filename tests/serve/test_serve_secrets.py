"""Secrets of `kvcache serve`: with --api-key every route but /health needs the key (the
/kvcache/* routes tell a client the model folder and the load; /metrics is scraped with a
bearer token), the scheme `Bearer` in any case; the key is compared as a digest; the URLs a
server was given (a Redis tier's, a handover's) and its key never appear in what it returns."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from runner.serve.auth import key_matches
from runner.serve.command import serve as serve_command
from runner.serve.masking import Masker
from tests.serve.conftest import ServeFactory

KEY = "sesame-open"
SECRET_URL = "redis://:hunter2@127.0.0.1:6399/0"


def test_every_route_but_health_needs_the_key(serve: ServeFactory) -> None:
    with serve(api_key=KEY) as server:
        for path in ("/kvcache/info", "/metrics", "/v1/models", "/no/such/route"):
            resp = httpx.get(f"{server.url}{path}", timeout=30)
            assert resp.status_code == 401, path
            assert resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        for scheme in ("Bearer", "bearer", "BEARER"):
            keyed = {"authorization": f"{scheme} {KEY}"}
            assert httpx.get(f"{server.url}/kvcache/info", headers=keyed).status_code == 200
            assert httpx.get(f"{server.url}/metrics", headers=keyed).status_code == 200
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=keyed, timeout=30)
            assert resp.status_code == 200, (scheme, resp.text)


@pytest.mark.parametrize(
    ("header", "matches"),
    [
        (f"Bearer {KEY}", True),
        (f"bearer {KEY}", True),
        (f"  bEaReR   {KEY} ", True),
        (f"Basic {KEY}", False),
        (KEY, False),
        (f"Bearer {KEY}x", False),
        (f"Bearer {KEY[:-1]}", False),
        ("Bearer", False),
        (None, False),
    ],
)
def test_key_matches(header: str | None, matches: bool) -> None:
    assert key_matches(header, KEY) is matches


def test_an_empty_key_is_refused_not_open(serve: ServeFactory) -> None:
    assert not key_matches("Bearer ", "")
    with pytest.raises(ValueError, match="api_key is empty"), serve(api_key=""):
        pass
    # `--api-key "$UNSET"`: refused before the model loads
    result = CliRunner().invoke(serve_command, ["--api-key", ""])
    assert result.exit_code == 2 and "the key is empty" in result.output, result.output


def test_error_texts_show_no_secret(serve: ServeFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    with serve(api_key=KEY, secret_urls=(SECRET_URL,)) as server:
        runner = server.state.llm.runner
        real_run = runner.run

        def run(scheduled: list[Any]) -> Any:  # a tier client's error quoting its URL
            if any("FAIL" in (item.seq.prompt_text or "") for item in scheduled):
                raise ConnectionError(f"Error connecting to {SECRET_URL} (key {KEY})")
            return real_run(scheduled)

        monkeypatch.setattr(runner, "run", run)
        keyed = {"authorization": f"Bearer {KEY}"}
        body = {"model": "tiny", "prompt": "FAIL", "max_tokens": 3}
        for stream in (False, True):
            resp = httpx.post(
                f"{server.url}/v1/completions",
                json={**body, "stream": stream},
                headers=keyed,
                timeout=30,
            )
            assert "redis://:***@127.0.0.1:6399/0" in resp.text, resp.text
            assert "hunter2" not in resp.text and KEY not in resp.text
        wrong_model = {"model": SECRET_URL, "prompt": "x"}
        resp = httpx.post(
            f"{server.url}/v1/completions", json=wrong_model, headers=keyed, timeout=30
        )
        assert resp.status_code == 404 and "hunter2" not in resp.text


def test_the_masker_masks_urls_and_keys() -> None:
    masker = Masker((SECRET_URL,), (KEY,))
    text = f"cannot reach {SECRET_URL} with {KEY}"
    assert masker.mask(text) == "cannot reach redis://:***@127.0.0.1:6399/0 with ***"
