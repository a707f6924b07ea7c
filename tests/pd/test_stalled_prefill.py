"""A prefill worker that stalls mid-handover (as a process paused with SIGSTOP does: it takes
the requests and answers none until it resumes): the decode worker's pull stops waiting after
its timeout, keeps the blocks that came before the stall, computes the rest, and the client
gets the colocated engine's answer, never a 500. The stall is a ZeroMQ relay in front of a real
prefill worker's handover endpoint that passes the first requests on and then sits on one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import zmq

from kvcache import LLM
from tests.pd.conftest import WorkerFactory
from tests.pd.test_handover import PROMPT, complete, expected
from tests.pd.test_transit_faults import prefill_only

ANSWERED = 3  # the relay passes this many requests on, then stalls on the next
STALL_S = 3.0  # the pause: longer than the pull's timeout
PULL_TIMEOUT_S = 1.0


@contextmanager
def stalling_relay(endpoint: str) -> Iterator[str]:
    """A ROUTER endpoint that relays requests to ``endpoint``, the ANSWERED+1th after a pause
    of STALL_S (its late answer goes to whoever asked, as a resumed process's would)."""
    context = zmq.Context()
    front = context.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    port = front.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def relay() -> None:
        back = context.socket(zmq.REQ)
        back.setsockopt(zmq.LINGER, 0)
        back.setsockopt(zmq.RCVTIMEO, 10_000)
        back.connect(endpoint)
        seen = 0
        while not stop.is_set():
            if not front.poll(100):
                continue
            ident, empty, request = front.recv_multipart()
            if seen == ANSWERED:
                stop.wait(STALL_S)
            seen += 1
            back.send(request)
            front.send_multipart([ident, empty, *back.recv_multipart()])
        back.close()

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(15)
        context.destroy(linger=0)


def test_a_prefill_worker_that_stalls_mid_handover_is_computed_around(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    with worker("prefill") as prefill, worker("decode") as decode:
        assert decode.parts.puller is not None
        decode.parts.puller.timeout_s = PULL_TIMEOUT_S
        params = prefill_only(prefill, body)
        with stalling_relay(params["endpoint"]) as relay:
            url = f"{decode.url}/kvcache/pull"
            pulled = httpx.post(url, json=params | {"endpoint": relay}, timeout=60)
            assert pulled.status_code == 200, pulled.text
        out = pulled.json()
        assert out["blocks"] == ANSWERED  # what came before the stall is used
        assert "did not answer" in out["reason"]
        answer = complete(decode, body)
        assert answer["choices"][0]["text"] == expected(reference_llm, PROMPT, 16)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == ANSWERED * decode.llm.config.block_size  # the rest computed here
        assert decode.parts.puller.stats()["failed_pulls"] == 1
        decode.llm.block_manager.check_integrity()
