"""The KV-event publisher: a block-manager listener whose own thread sends the events.

The engine's thread only appends events to a bounded queue (``blocks_stored`` and
``blocks_removed`` are called inside a step, under the engine's lock); the publisher's thread
takes whatever has queued, every ``FLUSH_S`` or sooner, as one ``EventBatch``, numbers it, sends
it on the PUB socket and keeps it in a ring of the last ``buffer_steps`` batches. A subscriber
that sees a gap in the numbers asks the replay socket (ROUTER, runner/kv_events/replay.py) for
the batches from a number on: it answers each as ``[seq, payload]`` and ends with ``[-1, b""]``,
as vLLM's does, a bounded share of them per request. A queue
past ``max_queue_size`` drops its oldest events and the next batch's number skips one, so the
subscriber learns of the loss instead of holding a wrong view without knowing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq

from kvcache.radix_tree import Node
from runner.kv_events.config import KVEventsConfig
from runner.kv_events.replay import ReplaySocket
from runner.kv_events.schema import (
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_batch,
)

log = logging.getLogger(__name__)

FLUSH_S = 0.005  # the longest an event waits in the queue while the thread is idle


def stored_events(nodes: list[Node], block_size: int, medium: str) -> list[BlockStored]:
    """``nodes`` (as one tree insert reports them, parents first) as BlockStored events, one per
    run of nodes that chain each to the one before it. Pure."""
    events: list[BlockStored] = []
    run: list[Node] = []
    for node in nodes:
        if run and node.parent is not run[-1]:
            events.append(_stored(run, block_size, medium))
            run = []
        run.append(node)
    if run:
        events.append(_stored(run, block_size, medium))
    return events


def _stored(run: list[Node], block_size: int, medium: str) -> BlockStored:
    parent = run[0].parent
    return BlockStored(
        block_hashes=[node.key for node in run],
        parent_block_hash=None if parent is None else parent.key,
        token_ids=[token for node in run for token in node.token_ids],
        block_size=block_size,
        lora_id=None,
        medium=medium,
    )


class EventQueue:
    """The events waiting for the publisher's thread, at most ``limit``: past it the oldest
    go, and the next ``take`` says so. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.dropped = 0  # events let go so far
        self._events: deque[Event] = deque()
        self._lost = False  # events were let go since the last take
        self._lock = threading.Lock()

    def put(self, events: list[Event]) -> None:
        """Queue ``events`` after the others. Mutates the queue (may drop its oldest)."""
        with self._lock:
            self._events.extend(events)
            over = len(self._events) - self.limit
            if over > 0:
                for _ in range(over):
                    self._events.popleft()
                self.dropped += over
                self._lost = True

    def take(self) -> tuple[list[Event], bool]:
        """Every queued event, oldest first, and whether some were let go before them.
        Mutates: the queue is left empty."""
        with self._lock:
            events, lost = list(self._events), self._lost
            self._events.clear()
            self._lost = False
        return events, lost


class KVEventPublisher:
    """Publishes one block manager's events (add it with ``BlockManager.add_listener``)."""

    def __init__(
        self, config: KVEventsConfig, block_size: int, *, medium: str = MEDIUM_POOL
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.medium = medium
        self.next_seq = 0  # the number the next batch is sent under
        self._queue = EventQueue(config.max_queue_size)
        # Publishes a reset's AllBlocksCleared with the blocks the tiers still hold after it.
        self.on_cleared: Callable[[AllBlocksCleared], None] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        # As vLLM's: bound on a wildcard host (or a port of 0, or ipc/inproc), else connected
        # to a subscriber that binds (llm-d's scheduler: every pod connects to it).
        self.binds = binds(config.endpoint)
        if self.binds:
            self.endpoint = _bind(self._pub, config.endpoint)
        else:
            self._pub.connect(config.endpoint)
            self.endpoint = config.endpoint
        self._replay: ReplaySocket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint:
            self._replay = ReplaySocket(self._context)
            self.replay_endpoint = _bind(self._replay.socket, config.replay_endpoint)
        # A fresh engine holds nothing: a subscriber that knew an earlier process on this
        # endpoint (a restarted replica) forgets what that one held.
        self._enqueue([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # -- the listener (engine thread) ---------------------------------------------------------
    def blocks_stored(self, nodes: list[Node]) -> None:
        self._enqueue(list(stored_events(nodes, self.block_size, self.medium)))

    def blocks_removed(self, nodes: list[Node]) -> None:
        self._enqueue([BlockRemoved(block_hashes=[node.key for node in nodes], medium=self.medium)])

    def publish(self, events: Sequence[Event]) -> None:
        """Queue other events (the tiers', runner/kv_events/tier_events.py) with the pool's,
        in one numbered stream. Thread-safe."""
        self._enqueue(list(events))

    def all_cleared(self) -> None:
        """Everything cached was dropped (a prefix-cache reset). AllBlocksCleared clears every
        medium of this engine for a subscriber; the tiers keep theirs, so their blocks follow
        it again (``on_cleared``: the tiers' TierEvents.cleared publishes both)."""
        if self.on_cleared is not None:
            self.on_cleared(AllBlocksCleared())
        else:
            self._enqueue([AllBlocksCleared()])

    def endpoints(self) -> dict[str, str | bool | None]:
        """Where a subscriber connects, as bound (a TCP port of 0 resolved; ``*`` stands for
        every interface of this host: a subscriber puts the host it reaches this one at)."""
        return {
            "endpoint": self.endpoint,
            "binds": self.binds,  # False: it connects to a subscriber bound at the endpoint
            "replay_endpoint": self.replay_endpoint,
            "topic": self.config.topic,
        }

    @property
    def dropped_events(self) -> int:
        """Events the full queue let go (each loss leaves a gap in the numbers)."""
        return self._queue.dropped

    def _enqueue(self, events: list[Event]) -> None:
        self._queue.put(events)
        self._wake.set()

    # -- the publisher's thread ----------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if self._replay is not None:
                    if poller.poll(int(FLUSH_S * 1000)):
                        self._replay.answer(self._ring)
                else:
                    self._wake.wait(FLUSH_S)
                self._wake.clear()
                self._flush()
            self._flush()
        except Exception:  # a broken socket must not take the engine down; events stop
            log.exception("KV events: the publisher's thread stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
            self._context.term()

    def _flush(self) -> None:
        events, lost = self._queue.take()
        if lost:
            self.next_seq += 1  # the lost events' number, never sent: the subscriber sees a gap
        if not events:
            return
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(EventBatch(ts=time.time(), events=events))
        seq_bytes = seq.to_bytes(8, "big")
        self._ring.append((seq, payload))
        self._pub.send_multipart([self.config.topic.encode(), seq_bytes, payload])

    def close(self) -> None:
        """Send what is queued and stop; the sockets are closed. Idempotent."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` (vLLM's rule: a wildcard host, ``*``, ``::`` or
    ``0.0.0.0``, or ipc:// / inproc://; ours adds a TCP port of 0, which nothing can connect to)
    or connects to it (a subscriber binds there). Pure."""
    wildcard = any(host in endpoint for host in ("*", "::", "0.0.0.0"))
    local = endpoint.startswith(("ipc://", "inproc://"))
    return wildcard or local or (endpoint.startswith("tcp://") and endpoint.endswith(":0"))


def _bind(socket: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind ``endpoint``; a TCP port of 0 binds a free one. Returns the endpoint bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = socket.bind_to_random_port(endpoint[: -len(":0")])
        return f"{endpoint[: -len(':0')]}:{port}"
    socket.bind(endpoint)
    return endpoint
