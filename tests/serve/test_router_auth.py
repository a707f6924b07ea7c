"""`kvcache router --api-key KEY --replica-api-key KEY2` with the official openai client, in
front of a real replica on loopback that asks for KEY2: the router's clients are checked
against the router's own key (401 in OpenAI's error shape otherwise, as the server answers),
and the replica gets its own key from the router, never the client's. Without a replica key
the client's key goes through (one key for both hops)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from kvcache import LLM, SamplingParams
from runner.router.app import build_router_app
from runner.router.pd import build_pd_router_app
from runner.router.proxy import RouterSettings
from runner.serve.app import ServeSettings, build_app
from tests.serve.conftest import LiveServer

ROUTER_KEY = "router-key-for-clients"
REPLICA_KEY = "replica-key-for-the-router"


@contextmanager
def keyed_cluster(
    llm: LLM, replica_key: str | None, api_key: str | None, replica_api_key: str | None = None
) -> Iterator[tuple[LiveServer, LiveServer]]:
    replica = LiveServer(build_app(llm, ServeSettings("tiny", api_key=replica_key))).start()
    settings = RouterSettings(policy="round_robin", health_interval_s=0.1)
    settings.api_key, settings.replica_api_key = api_key, replica_api_key
    proxy = LiveServer(build_router_app([replica.url], settings))
    try:
        yield proxy.start(), replica
    finally:
        proxy.stop()
        replica.stop()


def client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_the_router_checks_its_key_and_sends_the_replicas_theirs(
    tiny_llm: LLM, reference_llm: LLM
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = reference_llm.generate(["a key for each hop"], params)[0].text
    with keyed_cluster(tiny_llm, REPLICA_KEY, ROUTER_KEY, REPLICA_KEY) as (router, replica):
        api = client(router, ROUTER_KEY)
        out = api.completions.create(
            model="tiny", prompt="a key for each hop", max_tokens=8, temperature=0
        )
        assert out.choices[0].text == expected
        stream = api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_completion_tokens=6,
            stream=True,
        )
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
        assert api.models.list().data[0].id == "tiny"  # /v1/models goes upstream keyed too

        for wrong in ("wrong", REPLICA_KEY):  # the replica's key is no key for the router
            with pytest.raises(openai.AuthenticationError) as err:
                client(router, wrong).completions.create(model="tiny", prompt="x", max_tokens=2)
            assert err.value.status_code == 401
            assert err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):  # nor the router's for the replica
            client(replica, ROUTER_KEY).completions.create(model="tiny", prompt="x", max_tokens=2)

        bare = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"})
        assert bare.status_code == 401
        assert bare.json()["error"] == {
            "message": "invalid or missing API key",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        # Health and stats stay open; the replica counts only the keyed requests it served.
        assert httpx.get(f"{router.url}/health").json()["replicas_up"] == 1
        assert httpx.get(f"{router.url}/router/stats").json()["replicas"][0]["sent"] == 2


def test_without_a_replica_key_the_clients_key_goes_through(tiny_llm: LLM) -> None:
    with keyed_cluster(tiny_llm, ROUTER_KEY, ROUTER_KEY) as (router, _):
        out = client(router, ROUTER_KEY).completions.create(
            model="tiny", prompt="one key", max_tokens=3
        )
        assert out.choices[0].finish_reason == "length"
    with keyed_cluster(tiny_llm, REPLICA_KEY, None) as (router, _):  # a router asking none
        out = client(router, REPLICA_KEY).completions.create(
            model="tiny", prompt="passed on", max_tokens=3
        )
        assert out.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):  # the replica's own 401, relayed
            client(router, "wrong").completions.create(model="tiny", prompt="x", max_tokens=2)


def test_the_disaggregated_router_checks_the_key_too() -> None:
    # No worker is up: a keyed request gets as far as "no prefill worker" (503), an unkeyed
    # one no further than the key check.
    settings = RouterSettings(health_interval_s=60, api_key=ROUTER_KEY)
    app = build_pd_router_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], settings)
    proxy = LiveServer(app).start()
    try:
        url = f"{proxy.url}/v1/completions"
        assert httpx.post(url, json={"prompt": "x"}).status_code == 401
        keyed = {"authorization": f"Bearer {ROUTER_KEY}"}
        assert httpx.post(url, json={"prompt": "x"}, headers=keyed).status_code == 503
    finally:
        proxy.stop()
