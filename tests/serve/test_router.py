"""`kvcache router` in front of two real replicas on loopback (tiny model): every policy gives
the replicas' own answers, streams pass through chunk by chunk, cache_aware keeps a shared
prefix on the replica that holds it (with the engine's own block hashes) and sends a new one
to the idler replica, and a replica that dies is taken out with its requests retried."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvcache import LLM, SamplingParams, namespace_root
from runner.router.app import build_router_app
from runner.router.load import FirstToken
from runner.router.proxy import RouterSettings
from runner.serve.app import ServeSettings, build_app
from tests.serve.conftest import LiveServer, replica_servers

PREFIX_A = "You are a helpful assistant who answers about caches. " * 3
PREFIX_B = "Translate each sentence into French, keeping its tone. " * 3


@pytest.fixture(scope="module")
def replica_llms(tiny_llama_tok_dir: Path) -> list[LLM]:
    return [LLM(str(tiny_llama_tok_dir), num_kv_blocks=128) for _ in range(2)]


@contextmanager
def cluster(
    llms: list[LLM], policy: str, health_interval_s: float = 0.1
) -> Iterator[tuple[LiveServer, list[LiveServer]]]:
    settings = RouterSettings(policy=policy, health_interval_s=health_interval_s)
    with replica_servers(llms) as replicas:
        with LiveServer(build_router_app([r.url for r in replicas], settings)) as router:
            yield router, replicas


def sent(router: LiveServer) -> list[int]:
    return [r["sent"] for r in httpx.get(f"{router.url}/router/stats").json()["replicas"]]


def api(router: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def test_round_robin_and_streaming_pass_through(
    replica_llms: list[LLM], reference_llm: LLM
) -> None:
    prompts = [f"prompt number {i}: " for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.text for o in reference_llm.generate(prompts, params)]
    with cluster(replica_llms, "round_robin") as (router, _):
        client = api(router)
        got = [
            client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
            .choices[0]
            .text
            for p in prompts
        ]
        assert got == expected
        assert sent(router) == [2, 2]
        chunks = list(
            client.completions.create(
                model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, stream=True
            )
        )
        assert len(chunks) == 12  # one per token, as the replica sent them
        assert "".join(c.choices[0].text for c in chunks) == expected[0]
        assert client.models.list().data[0].id == "tiny"


def test_cache_aware_routes_by_the_engines_block_hashes(replica_llms: list[LLM]) -> None:
    with cluster(replica_llms, "cache_aware") as (router, replicas):
        client = api(router)
        for turn in range(3):  # each prefix's later turns go where its first went
            for prefix in (PREFIX_A, PREFIX_B):
                client.completions.create(
                    model="tiny", prompt=prefix + f"turn {turn}?", max_tokens=4, temperature=0
                )
        stats = httpx.get(f"{router.url}/router/stats").json()
        assert [r["sent"] for r in stats["replicas"]] == [3, 3]
        assert stats["reasons"] == {"least_loaded": 2, "prefix_match": 4}
        # The router's hashes are the engine's: the blocks it indexed are in the replica's tree.
        router_state = router.app.state.router
        for replica, server in zip(router_state.replicas.replicas, replicas, strict=True):
            llm = server.state.llm
            root = namespace_root(llm.fingerprint)
            cached = [
                prefix
                for prefix in (PREFIX_A, PREFIX_B)
                if llm.block_manager.cached_prefix_length(llm.tokenizer(prefix).input_ids, root)
                >= 16 * 3
            ]
            assert len(cached) == 1  # each replica holds one of the two prefixes
            ids = router_state.hasher.token_ids("/v1/completions", {"prompt": cached[0]})
            hashes = router_state.hasher.hashes(ids, replica.naming, None)
            assert replica.index.match(hashes) == len(hashes) > 0


def test_least_loaded_and_a_dead_replica(replica_llms: list[LLM]) -> None:
    # Health checks too rare to notice the death first: the failed request itself must.
    with cluster(replica_llms, "least_loaded", health_interval_s=60) as (router, replicas):
        body = {"model": "tiny", "prompt": "a", "max_tokens": 300, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=30
        ) as running:
            lines = running.iter_lines()
            next(lines)
            busy = sent(router).index(1)
            quick = api(router).completions.create(model="tiny", prompt="b", max_tokens=2)
            assert quick.choices and sent(router)[1 - busy] == 1  # the idle one took it
        replicas[1].stop()  # dies: its requests go to the other, which answers them all
        for i in range(4):
            out = api(router).completions.create(model="tiny", prompt=f"c{i}", max_tokens=2)
            assert out.choices[0].finish_reason == "length"
        stats = httpx.get(f"{router.url}/router/stats").json()
        assert [r["healthy"] for r in stats["replicas"]] == [True, False]
        metrics = httpx.get(f"{router.url}/metrics").text
        assert "kvcache_router_requests_total" in metrics
        assert "kvcache_router_retries_total 1.0" in metrics


def test_a_client_leaving_a_routed_stream_frees_the_replicas_blocks(
    replica_llms: list[LLM],
) -> None:
    with cluster(replica_llms, "round_robin") as (router, replicas):
        body = {"model": "tiny", "prompt": "leave early " * 3, "max_tokens": 400}
        body |= {"ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")  # passed through as the replica sent it
        server = replicas[0]
        deadline = time.monotonic() + 10
        while server.state.engine.live() or server.state.llm.has_unfinished():
            assert time.monotonic() < deadline, "the replica still runs the abandoned request"
            time.sleep(0.02)
        assert server.state.llm.stats()["blocks_in_use"] == 0
        server.state.llm.block_manager.check_integrity()
        assert httpx.get(f"{router.url}/router/stats").json()["replicas"][0]["in_flight"] == 0


def test_cache_aware_load_follows_a_streams_first_token_and_end(replica_llms: list[LLM]) -> None:
    """The router takes a request's prompt off its replica's load at the stream's first token
    (not at the role chunk a chat stream opens with) and the rest at its end."""
    chat: dict[str, Any] = {"model": "tiny", "max_tokens": 40, "ignore_eos": True, "stream": True}
    chat["messages"] = [{"role": "user", "content": "a long answer"}]
    with cluster(replica_llms, "cache_aware") as (router, _):
        url = f"{router.url}/v1/chat/completions"
        with httpx.stream("POST", url, json=chat, timeout=30) as resp:
            raw = b"".join(resp.iter_raw())
        events = [e for e in raw.split(b"\n\n") if e]
        first_text = next(
            i
            for i, e in enumerate(events)
            if e.startswith(b"data: {") and json.loads(e[6:])["choices"][0]["delta"].get("content")
        )
        watch = FirstToken()
        assert [watch.feed(e + b"\n\n") for e in events[: first_text + 1]] == [
            False
        ] * first_text + [True]
        # Every request's work is taken back when it ends, streamed or not.
        client = api(router)
        list(client.completions.create(model="tiny", prompt=PREFIX_A, max_tokens=8, stream=True))
        client.completions.create(model="tiny", prompt=PREFIX_B, max_tokens=8)
        deadline = time.monotonic() + 10
        while any(
            r["in_flight"] for r in httpx.get(f"{router.url}/router/stats").json()["replicas"]
        ):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stats = httpx.get(f"{router.url}/router/stats").json()["replicas"]
        assert [r["load_blocks"] for r in stats] == [0, 0]


def test_a_tokenizer_that_cannot_load_means_the_least_loaded_replica(
    replica_llms: list[LLM], tmp_path: Path
) -> None:
    replicas = [LiveServer(build_app(llm, ServeSettings("tiny"))).start() for llm in replica_llms]
    settings = RouterSettings(health_interval_s=0.1, tokenizer=str(tmp_path / "no-such-model"))
    router = LiveServer(build_router_app([r.url for r in replicas], settings)).start()
    try:
        for _ in range(2):  # the second does not try the tokenizer again
            body = {"prompt": PREFIX_A, "max_tokens": 4, "temperature": 0}
            answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
        state = router.app.state.router
        assert state.prompt_tokens.failed and state.hasher is None
        assert sorted(sent(router)) == [1, 1]  # least loaded: one each
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()
