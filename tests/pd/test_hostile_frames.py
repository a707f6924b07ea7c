"""Whatever bytes reach a prefill worker's handover endpoint, its serving thread survives: a
request it can read an envelope of is answered with an error naming the problem, a message
over the size bound has its sender disconnected, and a good handover afterwards still gives the
colocated engine's answer. A serving thread that is gone all the same is reported: /health
answers 503, so a router takes the worker out of rotation."""

from __future__ import annotations

import json

import httpx
import zmq

from kvcache import LLM
from runner.disagg.zmq_transport import MAX_REQUEST_BYTES, MAX_REQUEST_HASHES
from tests.pd.conftest import WorkerFactory
from tests.pd.test_handover import PROMPT, complete, expected, handover

ANSWER_WAIT_MS = 5_000

# (the frames a DEALER sends, a piece of the error the answer must name)
ANSWERED = [
    ([b"hello"], "no empty delimiter"),
    ([b"", b"not json"], "JSON"),
    ([b"", b"\xff\xfe"], "JSON"),
    ([b"", b"[1, 2]"], "JSON object"),
    ([b"", b'"get"'], "JSON object"),
    ([b"", b"{}"], "op"),
    ([b"", b'{"op": "get"}'], "id"),
    ([b"", b'{"op": "evict", "id": "h"}'], "get or release"),
    ([b"", b'{"op": "get", "id": "h", "hashes": 7}'], "hashes"),
    ([b"", b'{"op": "get", "id": "h", "hashes": ["x"]}'], "hashes"),
    ([b"", b'{"op": "get", "id": "h", "hashes": [1e400]}'], "hashes"),
    ([b"", b'{"op": "get", "id": "h", "hashes": [1.5]}'], "hashes"),
    ([b"", b'{"op": "get", "id": {"a": 1}, "hashes": []}'], "id"),
    ([b"", b"[" * 100_000 + b"]" * 100_000], "JSON"),
    (
        [
            b"",
            json.dumps({"op": "get", "id": "h", "hashes": [1] * (MAX_REQUEST_HASHES + 1)}).encode(),
        ],
        str(MAX_REQUEST_HASHES),
    ),  # fmt: skip
    ([b"", b"{}", b"{}"], "one frame"),
    ([b""], "one frame"),
]


def test_hostile_frames_leave_the_handover_serving(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    with worker("prefill") as prefill, worker("decode") as decode:
        publisher = prefill.parts.publisher
        assert publisher is not None and publisher.server is not None
        endpoint = publisher.server.endpoint
        context = zmq.Context()
        try:
            for frames, named in ANSWERED:
                peer = context.socket(zmq.DEALER)
                peer.setsockopt(zmq.LINGER, 0)
                peer.connect(endpoint)
                peer.send_multipart(frames)
                assert peer.poll(ANSWER_WAIT_MS), f"no answer to {frames[:2]!r}"
                empty, head = peer.recv_multipart()
                answer = json.loads(head)
                assert empty == b"" and answer["ok"] is False, answer
                assert named in answer["error"], (frames[:2], answer)
                peer.close()
            huge = context.socket(zmq.DEALER)  # over the bound: disconnected, not read
            huge.setsockopt(zmq.LINGER, 0)
            huge.connect(endpoint)
            huge.send_multipart([b"", b"{" * (MAX_REQUEST_BYTES + 1)])
            assert not huge.poll(500)
            huge.close()
        finally:
            context.destroy(linger=0)  # closes the sockets an assertion left open
        assert publisher.server.alive
        params, pulled = handover(prefill, decode, body)
        assert pulled["blocks"] == params["num_blocks"] > 0 and pulled["reason"] is None
        answer = complete(decode, body)
        assert answer["choices"][0]["text"] == expected(reference_llm, PROMPT, 16)
        assert httpx.get(f"{prefill.url}/health").status_code == 200


def test_a_gone_handover_thread_makes_the_worker_unhealthy(worker: WorkerFactory) -> None:
    with worker("prefill") as prefill:
        assert httpx.get(f"{prefill.url}/health").status_code == 200
        publisher = prefill.parts.publisher
        assert publisher is not None and publisher.server is not None
        publisher.server.close()  # its thread ends, as a thread that died would
        health = httpx.get(f"{prefill.url}/health")
        assert health.status_code == 503
        assert "handover" in health.json()["status"]
