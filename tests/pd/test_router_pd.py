"""`kvcache router --prefill ... --decode ...` in front of real workers on loopback: answers
(whole and streamed, completions and chat) equal the colocated engine's; a prefill worker that
is down is skipped, and with none left the request fails cleanly (503); with no decode worker
left the prefill worker is told to free the handover; a decode worker killed mid-stream (a
real process, SIGKILL) ends the client's stream with an error event, and the prefill worker
holds nothing for it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

from kvcache import LLM, SamplingParams
from runner.router.pd import build_pd_router_app
from runner.router.proxy import RouterSettings
from tests.pd.conftest import Worker, WorkerFactory
from tests.pd.test_handover import PROMPT
from tests.redis_server import free_port
from tests.serve.conftest import LiveServer

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def pd_router(prefill: list[str], decode: list[str]) -> Iterator[LiveServer]:
    settings = RouterSettings(health_interval_s=0.1)
    router = LiveServer(build_pd_router_app(prefill, decode, settings)).start()
    try:
        yield router
    finally:
        router.stop()


def api(router: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def held(prefill: Worker) -> int:
    return httpx.get(f"{prefill.url}/kvcache/disagg").json()["published"]["held"]


def test_router_answers_as_the_colocated_engine(worker: WorkerFactory, reference_llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=0)
    (want,) = [o.text for o in reference_llm.generate([PROMPT], params)]
    messages = [{"role": "user", "content": PROMPT}]
    (want_chat,) = reference_llm.chat([messages], params)
    with worker("prefill") as prefill, worker("decode") as decode:
        with pd_router([prefill.url], [decode.url]) as router:
            client = api(router)
            whole = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=20, temperature=0
            )
            assert whole.choices[0].text == want
            stream = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in stream if c.choices) == want
            chat = client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=20,
                temperature=0,  # type: ignore[arg-type]
            )
            assert chat.choices[0].message.content == want_chat.text
            stats = httpx.get(f"{router.url}/router/stats").json()
            assert stats["handover"]["blocks"] > 0 and stats["handover"]["bytes"] > 0
        assert held(prefill) == 0  # every handover was pulled and released


def test_a_dead_prefill_worker_is_skipped_then_fails_cleanly(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    params = SamplingParams(max_tokens=8, temperature=0)
    (want,) = [o.text for o in reference_llm.generate([PROMPT], params)]
    with worker("prefill") as prefill, worker("decode") as decode:
        with pd_router([dead, prefill.url], [decode.url]) as router:
            answer = api(router).completions.create(
                model="tiny", prompt=PROMPT, max_tokens=8, temperature=0
            )
            assert answer.choices[0].text == want
            prefill.server.stop()  # now every prefill worker is gone
            reply = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT}, timeout=30)
            assert reply.status_code == 503
            assert "no prefill worker" in reply.json()["error"]["message"]


def test_no_decode_worker_frees_the_handover(worker: WorkerFactory) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with worker("prefill") as prefill, pd_router([prefill.url], [dead]) as router:
        reply = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert reply.status_code == 503
        assert "no decode worker" in reply.json()["error"]["message"]
        stats = httpx.get(f"{prefill.url}/kvcache/disagg").json()["published"]
        assert stats["handovers"] == 1 and stats["held"] == 0 and stats["released"] == 1


@contextmanager
def decode_process(model_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`kvcache serve --role decode` as its own process (so it can be killed outright)."""
    port = free_port()
    args = [sys.executable, "-c", "import cli; cli.main()", "serve", "--model", str(model_dir)]
    args += ["--port", str(port), "--role", "decode", "--num-kv-blocks", "256", "--cpus", "0"]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            assert time.monotonic() < deadline, "the decode worker did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def test_decode_worker_killed_mid_stream(worker: WorkerFactory, tiny_llama_tok_dir: Path) -> None:
    with worker("prefill") as prefill, decode_process(tiny_llama_tok_dir) as (process, url):
        with pd_router([prefill.url], [url]) as router:
            body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}
            body |= {"ignore_eos": True}
            events: list[str] = []
            with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if len(events) == 3:
                        os.kill(process.pid, signal.SIGKILL)
            assert events[-1] == "[DONE]"
            assert "died mid-stream" in events[-2]
        assert held(prefill) == 0  # it had pulled (and released) before it died


def test_a_client_that_leaves_frees_the_blocks_on_both_workers(worker: WorkerFactory) -> None:
    with worker("prefill") as prefill, worker("decode") as decode:
        with pd_router([prefill.url], [decode.url]) as router:
            body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}
            body |= {"ignore_eos": True}
            with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n == 4:
                        break  # the client goes away mid-stream
            deadline = time.monotonic() + 20
            while decode.server.state.engine.live() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert decode.server.state.engine.live() == 0  # aborted on the decode worker
        assert held(prefill) == 0 and prefill.server.state.engine.live() == 0
        for side in (prefill, decode):
            with side.llm.lock:
                side.llm.block_manager.check_integrity()
                bm = side.llm.block_manager
                assert bm.num_available_blocks() == bm.num_blocks  # nothing held by a request


def test_the_api_key_guards_the_handover_routes(worker: WorkerFactory, reference_llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=0)
    (want,) = [o.text for o in reference_llm.generate([PROMPT], params)]
    with worker("prefill", api_key="k") as prefill, worker("decode", api_key="k") as decode:
        for url in (f"{prefill.url}/kvcache/prefill/v1/completions", f"{decode.url}/kvcache/pull"):
            assert httpx.post(url, json={"prompt": PROMPT}).status_code == 401
        with pd_router([prefill.url], [decode.url]) as router:
            client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="k", max_retries=0)
            answer = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=8, temperature=0
            )
            assert answer.choices[0].text == want
