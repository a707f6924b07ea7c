"""The KV-event publisher's replay socket (a ZeroMQ ROUTER, vLLM's protocol): a subscriber that
missed batches asks for them from a number on, ``[b"", start]`` from a DEALER (or ``[start]``
from a REQ), and gets each kept batch as ``[seq, payload]``, then ``[-1, b""]``.

The socket has no key, and any peer may ask. Before it was bounded, each request was answered
with every kept batch at once, and ZeroMQ queued up to 1,000 messages for a peer that never
read: 40 silent requests added 964 MiB to the publisher (issue 51). So:

- one answer holds at most REPLAY_MAX_BATCHES batches and REPLAY_MAX_BYTES bytes (at least one
  batch); a subscriber asks again from the next number for the rest;
- a peer's queue holds one answer (REPLAY_HWM messages): a request that finds it full is not
  answered further;
- a peer that stops reading is dropped when it misses ZeroMQ's heartbeats (HEARTBEAT_TIMEOUT_MS),
  and its queue with it;
- across peers, at most REPLAY_WINDOW_BYTES are answered in any REPLAY_WINDOW_S: a request past
  it gets the end marker alone (warned once a window), so however many peers ask, what the
  socket queues stays bounded;
- payloads are sent without a copy (ZeroMQ keeps a reference to the kept batch's bytes).
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

import zmq

log = logging.getLogger(__name__)

REPLAY_MAX_BATCHES = 1_000  # batches in one answer
REPLAY_MAX_BYTES = 4 << 20  # payload bytes in one answer (past the first batch)
REPLAY_HWM = REPLAY_MAX_BATCHES + 1  # messages queued for one peer: one answer and its end
REPLAY_WINDOW_S = 10.0
REPLAY_WINDOW_BYTES = 64 << 20  # payload bytes answered across peers in any REPLAY_WINDOW_S
REQUEST_MAX_BYTES = 256  # a request frame is 8 bytes (a handshake frame a little more)
HEARTBEAT_IVL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 5_000  # no answer to a heartbeat for this long: the peer is dropped
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the answer's last frame's number


class ReplayBudget:
    """The payload bytes answered within the last ``window_s`` seconds, across peers."""

    def __init__(
        self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._spent: deque[tuple[float, int]] = deque()  # (when, bytes), oldest first
        self._total = 0

    def room(self) -> int:
        """The bytes that may still be answered now. Mutates: forgets what left the window."""
        since = self.clock() - self.window_s
        while self._spent and self._spent[0][0] < since:
            self._total -= self._spent.popleft()[1]
        return self.limit - self._total

    def spend(self, nbytes: int) -> None:
        if nbytes:
            self._spent.append((self.clock(), nbytes))
            self._total += nbytes


class ReplaySocket:
    """The bound ROUTER socket and its answers (called from the publisher's thread only)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.socket: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises, never blocks
        self.socket.setsockopt(zmq.MAXMSGSIZE, REQUEST_MAX_BYTES)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.budget = ReplayBudget(REPLAY_WINDOW_BYTES, REPLAY_WINDOW_S)
        self._warned_at = -REPLAY_WINDOW_S

    def answer(self, ring: Iterable[tuple[int, bytes]]) -> None:
        """One request: ``[identity, b"", start]`` from a REQ socket or ``[identity, start]``
        from a DEALER answered with the kept batches from ``start`` on, within the bounds
        above; any other shape gets the end marker alone."""
        frames = self.socket.recv_multipart()
        head = frames[:2] if len(frames) == 3 and frames[1] == b"" else frames[:1]
        start_bytes = frames[-1] if len(frames) in (2, 3) else b""
        start = int.from_bytes(start_bytes, "big") if len(start_bytes) == 8 else None
        room = min(REPLAY_MAX_BYTES, self.budget.room())
        if start is not None and room <= 0:
            self._warn_spent()
        sent = count = 0
        try:
            if start is not None and room > 0:
                for seq, payload in list(ring):
                    if seq < start:
                        continue
                    if count and (count >= REPLAY_MAX_BATCHES or sent + len(payload) > room):
                        break  # the rest in the next request, from the next number
                    parts = [*head, seq.to_bytes(8, "big"), payload]
                    self.socket.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
                    sent += len(payload)
                    count += 1
            self.socket.send_multipart([*head, END_SEQ, b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError as err:  # its queue is full (it does not read), or it left
            if err.errno not in (zmq.EAGAIN, errno.EHOSTUNREACH):
                raise
        finally:
            self.budget.spend(sent)

    def _warn_spent(self) -> None:
        now = time.monotonic()
        if now - self._warned_at >= REPLAY_WINDOW_S:
            self._warned_at = now
            log.warning(
                "KV events: replay answers reached %d MiB in %g s; requests get no batches "
                "until the window frees",
                REPLAY_WINDOW_BYTES >> 20,
                REPLAY_WINDOW_S,
            )

    def close(self) -> None:
        self.socket.close()
