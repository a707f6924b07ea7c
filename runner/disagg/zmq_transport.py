"""The direct handover path: the prefill worker serves the values it holds (held.py) on a
ZeroMQ ROUTER socket; the decode worker asks for them by block hash, a chunk at a time, on a
REQ socket, and releases the handover when it has them. No store in between.

Wire: a request is one JSON frame, ``{"op": "get", "id": ID, "hashes": [...]}`` or
``{"op": "release", "id": ID}``; the answer is a JSON frame ``{"ok": true}`` followed, for a
get, by one frame per hash: the block value, or an empty frame where none is held; the head
says ``"open": true`` while the handover is still being filled by its prefill (an empty frame
may be filled yet: the client asks again). Anything else is answered ``{"ok": false, "error":
...}`` naming the problem (the bounds: MAX_REQUEST_HASHES, MAX_REQUEST_BYTES). Every wait is
bounded (``timeout_s`` an answer, ``open_wait_s`` an open handover): a prefill worker that
stalled or died is a miss for the decode worker, whose request then computes the rest of its
prompt itself."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

import zmq

from runner.disagg.held import HeldHandovers
from runner.serve.json_types import JSONObject

log = logging.getLogger(__name__)

POLL_MS = 200  # how often the serving thread looks at its stop flag
DEFAULT_TIMEOUT_S = 5.0
OPEN_POLL_S = 0.05  # how often a pull asks again for blocks its prefill has not committed yet
DEFAULT_OPEN_WAIT_S = 600.0  # the longest a pull waits on one open handover
# The bounds of a request. A get names at most a chunk of blocks (the pull's default is one);
# 4,096 hashes are a 64k-token prompt's chain at 16 tokens a block, ~90 KB of JSON, well under
# the frame bound. A peer whose frame passes MAX_REQUEST_BYTES is disconnected by ZeroMQ
# (ZMQ_MAXMSGSIZE) before anything is read.
MAX_REQUEST_HASHES = 4096
MAX_REQUEST_BYTES = 1 << 20


class BadRequest(ValueError):
    """A request the server cannot take; its text is the answer's error."""


class ZmqHandoverServer:
    """The prefill side: one thread answering gets and releases from ``held``. Any bytes a peer
    sends are answered (an error naming the problem where an envelope can be read) or dropped
    with their sender (past the size bound); none ends the thread, whose state ``alive`` says
    (the worker's /health reports a thread gone all the same)."""

    def __init__(self, held: HeldHandovers, host: str = "127.0.0.1", port: int = 0) -> None:
        self.held = held
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.served_blocks = 0
        self.served_bytes = 0
        self.bad_requests = 0  # requests answered with an error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-handover", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the serving thread runs (False once closed, or if it ended any other way)."""
        return self._thread.is_alive()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(POLL_MS):
                    continue
                frames = self._socket.recv_multipart(copy=False)
                # Not copied (the values are immutable bytes their frames keep alive): a
                # one-block pull 90 ms against 111-141 ms copied (scripts/handover_transports.py).
                self._socket.send_multipart(self._reply(frames), copy=False)
        except Exception:  # the socket itself failed: say so; /health reports the thread gone
            log.exception("the handover server at %s stopped", self.endpoint)
        finally:
            self._socket.close()
            self._context.term()

    def _reply(self, frames: list[zmq.Frame]) -> list[bytes | zmq.Frame]:
        """The answer to one message off the ROUTER socket: its envelope (the sender's identity,
        any routing frames, the empty delimiter, as a REQ socket sends them) and the answer's
        frames. A message with no delimiter is answered after one, so a DEALER hears why."""
        ident, rest = frames[0], frames[1:]
        delimiter = next((i for i, frame in enumerate(rest) if not len(frame)), None)
        envelope = [ident, *rest[: delimiter + 1]] if delimiter is not None else [ident, b""]
        try:
            if delimiter is None:
                raise BadRequest("no empty delimiter: a request is an empty frame, one JSON frame")
            body = rest[delimiter + 1 :]
            if len(body) != 1:
                raise BadRequest(f"a request is one frame after the delimiter, got {len(body)}")
            return [*envelope, *self._answer(body[0].bytes)]
        except BadRequest as err:
            self.bad_requests += 1
            return [*envelope, _error(str(err))]
        except Exception as err:  # a fault of ours: this request fails, the thread goes on
            log.exception("a handover request failed")
            return [*envelope, _error(f"internal error: {err!r}")]

    def _answer(self, raw: bytes) -> list[bytes]:
        op, handover_id, hashes = parse_request(raw)
        if op == "release":
            self.held.release(handover_id)
            return [b'{"ok": true}']
        values, still_open = self.held.get_open(handover_id, hashes)
        found = [v for v in values if v is not None]
        self.served_blocks += len(found)
        self.served_bytes += sum(len(v) for v in found)
        head = json.dumps({"ok": True, "open": still_open}).encode()
        return [head, *(v if v is not None else b"" for v in values)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def parse_request(raw: bytes) -> tuple[str, str, list[int]]:
    """(op, handover id, hashes: empty for a release) of a request frame. Raises BadRequest
    naming the field and its bound."""
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError) as err:  # RecursionError: nesting past the parser's
        raise BadRequest(f"the request is not JSON: {str(err)[:200]}") from None
    if not isinstance(request, dict):
        raise BadRequest(f"the request must be a JSON object, got {type(request).__name__}")
    op, handover_id = request.get("op"), request.get("id")
    if op not in ("get", "release"):
        raise BadRequest(f"op: get or release, got {str(op)[:50]!r}" if op else "op: missing")
    if isinstance(handover_id, bool) or not isinstance(handover_id, (str, int)):
        raise BadRequest(f"id: a string, got {type(handover_id).__name__}")
    if op == "release":
        return op, str(handover_id), []
    hashes = request.get("hashes")
    if not isinstance(hashes, list):
        raise BadRequest(f"hashes: a list of block hashes, got {type(hashes).__name__}")
    if len(hashes) > MAX_REQUEST_HASHES:
        message = f"hashes: at most {MAX_REQUEST_HASHES} a request, got {len(hashes)}"
        raise BadRequest(message)
    if not all(type(h) is int for h in hashes):  # not bool, float (1e400 is inf) or str
        raise BadRequest("hashes: each an integer")
    return op, str(handover_id), hashes


def _error(message: str) -> bytes:
    return json.dumps({"ok": False, "error": message}).encode()


class HandoverUnreachable(ConnectionError):
    """The prefill worker did not answer in time (or answered with an error)."""


class ZmqHandoverClient:
    """The decode side: one REQ socket at a time to a prefill worker's endpoint for one pull.
    A REQ socket that sent a request and got no answer takes no other request (it waits for
    that answer forever), so after a timeout it is closed and a fresh one connected (ZeroMQ's
    "lazy pirate" pattern): the release that follows a stalled get reaches the worker if it
    resumes, and a late answer to the get goes to the closed socket, never to the release."""

    def __init__(self, endpoint: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not endpoint.startswith("tcp://"):
            raise ValueError(f"a ZeroMQ handover endpoint is tcp://host:port, got {endpoint!r}")
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._timeout_ms = int(timeout_s * 1000)
        self.endpoint = endpoint
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
        socket.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        socket.connect(self.endpoint)
        return socket

    def _call(self, request: Mapping[str, object]) -> tuple[JSONObject, list[memoryview]]:
        """The answer's head and its frames, as views of ZeroMQ's own buffers (no copy). The
        pull copies each once into the pool and drops it, so the next frames reuse its memory:
        0.17 ms CPU a block of the default model on the decode worker's core, against 0.47 ms
        copied into fresh bytes and 0.74 ms kept (both page faults)."""
        try:
            self._socket.send(json.dumps(request).encode())
            head, *frames = self._socket.recv_multipart(copy=False)
        except zmq.ZMQError as err:  # zmq.Again: no answer in time
            self._socket.close()  # stuck waiting for that answer: a fresh socket for the next
            self._socket = self._connect()
            if isinstance(err, zmq.Again):
                raise HandoverUnreachable(f"{self.endpoint} did not answer in time") from err
            raise HandoverUnreachable(f"{self.endpoint}: {err}") from err
        try:
            answer = json.loads(head.bytes)
        except ValueError as err:
            raise HandoverUnreachable(f"{self.endpoint}: an answer that is not JSON") from err
        if not isinstance(answer, dict) or not answer.get("ok"):
            error = answer.get("error") if isinstance(answer, dict) else answer
            raise HandoverUnreachable(f"{self.endpoint}: {str(error)[:200]}")
        return answer, [frame.buffer for frame in frames]

    def fetch(
        self,
        handover_id: str,
        hashes: Sequence[int],
        chunk_blocks: int,
        open_wait_s: float = DEFAULT_OPEN_WAIT_S,
    ) -> Iterator[list[memoryview | None]]:
        """The values of ``hashes``, ``chunk_blocks`` at a time (None where not held). While
        the handover is open, a chunk is asked for again until its values are all there (each
        comes as its prefill commits it) or the handover closes."""
        deadline = time.monotonic() + open_wait_s
        for start in range(0, len(hashes), chunk_blocks):
            chunk = [int(h) for h in hashes[start : start + chunk_blocks]]
            values: list[memoryview | None] = [None] * len(chunk)
            while True:
                missing = [i for i, v in enumerate(values) if v is None]  # asked for once only
                request = {"op": "get", "id": handover_id, "hashes": [chunk[i] for i in missing]}
                head, frames = self._call(request)
                for i, frame in zip(missing, frames, strict=False):
                    values[i] = frame or None
                if None not in values or not head.get("open") or time.monotonic() > deadline:
                    break
                time.sleep(OPEN_POLL_S)
            yield values

    def release(self, handover_id: str) -> None:
        self._call({"op": "release", "id": handover_id})

    def close(self) -> None:
        self._socket.close()
