"""`kvcache router --kv-events` in front of two real replicas publishing vLLM's KV events on
loopback: the router's view of each replica is exactly the blocks its engine caches (by the
engine's own chained hashes), under concurrent load and through an eviction storm; requests
follow what the replicas hold, not what was routed to them; a replica found dead has its view
dropped; and `kvcache serve --kv-events-config` reports where it publishes."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcache import LLM, block_hashes
from runner.kv_events.schema import BlockStored, EventBatch
from runner.router.app import build_router_app
from runner.router.event_index import EventIndex
from runner.router.policy import CacheAware
from runner.router.proxy import RouterSettings
from runner.router.replicas import Replica
from tests.serve.conftest import LiveServer, replica_servers

EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:0",
    "replay_endpoint": "tcp://127.0.0.1:0",
}
PREFIX_A = "You are a helpful assistant who answers about caches. " * 3


def publishing(model: Path, num_kv_blocks: int, endpoint: str = "tcp://127.0.0.1:0") -> LLM:
    events = EVENTS | {"endpoint": endpoint}
    return LLM(str(model), num_kv_blocks=num_kv_blocks, kv_events_config=events)


@contextmanager
def cluster(
    llms: list[LLM], health_interval_s: float = 0.1, given: bool = False
) -> Iterator[tuple[LiveServer, list[LiveServer]]]:
    settings = RouterSettings(health_interval_s=health_interval_s, kv_events=True)
    try:
        with replica_servers(llms) as replicas:
            if given:  # --kv-events-endpoint URL=ENDPOINT,REPLAY for each
                for llm, replica in zip(llms, replicas, strict=True):
                    assert llm.kv_events is not None
                    ends = f"{llm.kv_events.endpoint},{llm.kv_events.replay_endpoint}"
                    settings.kv_events_endpoints[replica.url] = ends
            with LiveServer(build_router_app([r.url for r in replicas], settings)) as router:
                yield router, replicas
    finally:
        for llm in llms:
            if llm.kv_events is not None:
                llm.kv_events.close()


def engine_hashes(llm: LLM) -> set[int]:
    """The chained hash of every full block the engine's pool caches, from its own listing."""
    size = llm.config.block_size
    listing = {c.block_id: c for c in llm.block_manager.cached_blocks() if len(c.token_ids) == size}
    out = set()
    for block in listing.values():
        tokens: list[int] = []
        walk = block
        while True:
            tokens[:0] = walk.token_ids
            if walk.parent is None:
                break
            walk = listing[walk.parent]
        out.add(block_hashes(tokens, size, block.root)[-1])
    return out


def view(router: LiveServer, i: int, medium: str = "GPU") -> set[int]:
    """The router's view of replica i (copied off the router's thread: retried if it moved)."""
    index = router.app.state.router.replicas.replicas[i].index
    assert isinstance(index, EventIndex)
    for _ in range(100):
        try:
            return index.blocks(medium)
        except RuntimeError:  # changed size while copied
            time.sleep(0.01)
    raise AssertionError("the view never held still")


def agrees(router: LiveServer, i: int, llm: LLM) -> bool:
    return view(router, i) == engine_hashes(llm)


def eventually(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def complete(url: str, prompt: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


@pytest.mark.parametrize(
    ("pool_blocks", "given"),
    [(512, False), (24, False), (24, True)],  # roomy; an eviction storm; endpoints by flag
)
def test_the_routers_view_is_each_replicas_cache(
    tiny_llama_tok_dir: Path, pool_blocks: int, given: bool
) -> None:
    llms = [publishing(tiny_llama_tok_dir, pool_blocks) for _ in range(2)]
    rng = random.Random(pool_blocks)
    stems = [
        "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(40, 90))) for _ in range(6)
    ]
    with cluster(llms, given=given) as (router, replicas):
        feeds = router.app.state.router.feeds
        assert bool(feeds.given) == given
        info = httpx.get(f"{replicas[0].url}/kvcache/info").json()
        assert info["kv_events"]["endpoint"] == llms[0].kv_events.endpoint  # type: ignore[union-attr]
        for _ in range(2):  # a bounded load: 24 requests, 6 at a time
            prompts = [rng.choice(stems) + f" {rng.randrange(10**6)}" for _ in range(24)]
            with ThreadPoolExecutor(6) as pool:
                list(pool.map(lambda p: complete(router.url, p), prompts))
            for i, llm in enumerate(llms):
                eventually(partial(agrees, router, i, llm))
                assert view(router, i)
        evicted = [llm.block_manager.stats.evicted_blocks for llm in llms]
        assert all((e > 0) == (pool_blocks < 100) for e in evicted), evicted
        stats = httpx.get(f"{router.url}/router/stats").json()["replicas"]
        assert all(r["kv_events"]["last_seq"] > 0 for r in stats)


def test_requests_follow_what_the_replicas_hold(tiny_llama_tok_dir: Path) -> None:
    """Not what was routed: a replica whose cache was reset is no longer where a prefix goes,
    and one that computed it outside the router is."""
    llms = [publishing(tiny_llama_tok_dir, 256) for _ in range(2)]
    with cluster(llms) as (router, replicas):
        first = complete(router.url, PREFIX_A + "turn 0?")
        assert first["choices"]
        held = next(i for i in range(2) if llms[i].block_manager.stats.blocks_cached)
        eventually(lambda: len(view(router, held)) >= 3)
        assert llms[held].reset_prefix_cache()
        eventually(lambda: view(router, held) == set())
        other = 1 - held
        complete(replicas[other].url, PREFIX_A + "turn 1?")  # straight to the other replica
        eventually(lambda: view(router, other) == engine_hashes(llms[other]) != set())
        before = [r["sent"] for r in httpx.get(f"{router.url}/router/stats").json()["replicas"]]
        complete(router.url, PREFIX_A + "turn 2?")
        stats = httpx.get(f"{router.url}/router/stats").json()
        after = [r["sent"] for r in stats["replicas"]]
        assert after[other] == before[other] + 1
        assert stats["reasons"].get("prefix_match") == 1


def test_a_dead_replicas_view_is_dropped(tiny_llama_tok_dir: Path) -> None:
    llms = [publishing(tiny_llama_tok_dir, 256) for _ in range(2)]
    with cluster(llms) as (router, replicas):
        for turn in range(4):
            complete(router.url, f"question {turn}: " + PREFIX_A)
        for i, llm in enumerate(llms):
            eventually(partial(agrees, router, i, llm))
        busy = max(range(2), key=lambda i: len(view(router, i)))
        assert view(router, busy)
        replicas[busy].stop()  # its engine (and its publisher) live on: the view still goes
        eventually(lambda: not router.app.state.router.replicas.replicas[busy].healthy)
        assert view(router, busy) == set()
        assert len(router.app.state.router.replicas.replicas[busy].index) == 0


def test_the_flags_refuse_what_cannot_work(tiny_llama_tok_dir: Path) -> None:
    """vLLM's --kv-events-config is checked before the model loads, naming the bad key; the
    router's --kv-events needs the cache-aware policy over --replica URLs."""
    from click.testing import CliRunner

    from cli import main

    bad = CliRunner().invoke(
        main, ["serve", str(tiny_llama_tok_dir), "--kv-events-config", '{"endpont": "tcp://*:1"}']
    )
    assert bad.exit_code == 2 and "--kv-events-config" in bad.output and "endpont" in bad.output
    router = ["router", "--replica", "http://127.0.0.1:1", "--kv-events"]
    refused = CliRunner().invoke(main, [*router, "--policy", "round_robin"])
    assert refused.exit_code == 2 and "--kv-events goes with" in refused.output
    for given, problem in [
        ("http://127.0.0.1:2=tcp://127.0.0.1:5557", "names no --replica: http://127.0.0.1:2"),
        ("http://127.0.0.1:1=http://127.0.0.1:5557", "not a ZeroMQ endpoint"),
        ("tcp://127.0.0.1:5557", "want URL=ENDPOINT"),
    ]:
        bad_flag = CliRunner().invoke(main, [*router, "--kv-events-endpoint", given])
        assert bad_flag.exit_code == 2 and problem in bad_flag.output, bad_flag.output


def stored(hashes: list[int], medium: str) -> EventBatch:
    """One batch storing a chain of 16-token blocks in ``medium``."""
    tokens = list(range(16 * len(hashes)))
    event = BlockStored(hashes, None, tokens, 16, None, medium)
    return EventBatch(ts=1.0, events=[event])


def test_a_prefix_in_the_pool_goes_before_one_in_a_tier() -> None:
    """Two replicas hold a prompt's blocks, one in its host tier (CPU), the other in its pool
    (GPU): at equal loads the pool wins (a tier's block costs a copy up); a replica holding
    more of the prompt in any medium still wins over both."""
    hashes = [11, 12, 13, 14]
    views = [EventIndex() for _ in range(3)]
    reps = [Replica(f"http://r{i}", healthy=True, index=view) for i, view in enumerate(views)]
    views[0].apply(0, stored(hashes, "CPU"))
    views[1].apply(0, stored(hashes, "GPU"))
    route = CacheAware().choose(reps[:2], lambda r: hashes)
    assert route.replica is reps[1] and route.reason == "prefix_match"
    views[2].apply(0, stored([*hashes, 15], "DISK"))
    assert CacheAware().choose(reps, lambda r: [*hashes, 15, 16]).replica is reps[2]


def test_the_commands_end_to_end(tiny_llama_tok_dir: Path) -> None:
    """`kvcache serve --kv-events-config` (bound on every interface, as vLLM's default) and
    `kvcache router --kv-events` as processes: the serve reports its endpoints, and the
    router's view of it holds as many blocks as a subscriber of the test's own sees."""
    import os
    import subprocess
    import sys

    from tests.kv_events.subscriber import Subscriber

    repo = Path(__file__).resolve().parents[2]
    ports = []
    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
    serve_port, router_port, pub_port, replay_port = ports
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}"}
    config["replay_endpoint"] = f"tcp://*:{replay_port}"
    cli = [sys.executable, str(repo / "cli.py")]
    serve = [*cli, "serve", "--model", str(tiny_llama_tok_dir), "--port", str(serve_port)]
    serve += ["--served-model-name", "tiny", "--num-kv-blocks", "64"]
    serve += ["--kv-events-config", json.dumps(config)]
    router = [*cli, "router", "--replica", f"http://127.0.0.1:{serve_port}", "--kv-events"]
    router += ["--port", str(router_port), "--health-interval", "0.1"]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    procs = [subprocess.Popen(command, env=env) for command in (serve, router)]
    watcher = Subscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        for port in (serve_port, router_port):
            eventually(partial(healthy, f"http://127.0.0.1:{port}"), 60.0)
        info = httpx.get(f"http://127.0.0.1:{serve_port}/kvcache/info").json()
        assert info["kv_events"]["endpoint"] == f"tcp://*:{pub_port}"
        for turn in range(3):
            complete(f"http://127.0.0.1:{router_port}", f"{PREFIX_A} turn {turn}?")
        watcher.drain()
        assert watcher.blocks

        def agreed() -> bool:
            stats = httpx.get(f"http://127.0.0.1:{router_port}/router/stats").json()
            return bool(stats["replicas"][0]["kv_events"]["blocks"] == {"GPU": len(watcher.blocks)})

        eventually(agreed)
    finally:
        watcher.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
