"""Following each replica's KV events into its EventIndex (`kvcache router --kv-events`).

A replica's endpoints come from its /kvcache/info (``kv_events``: where `kvcache serve
--kv-events-config` bound them; a wildcard host, ``tcp://*:5557``, is reached at the host the
router reaches the replica's HTTP at). Per replica, one SUB socket: the history first, asked of
the replay socket from number 0 (the publisher keeps its last ``buffer_steps`` batches), then
the live batches in order. A batch whose number skips some is preceded by a replay of the
missing ones; a number already applied is a duplicate (a replay overlapping the stream) unless
its batch is newer than the last one applied: then the publisher started over (a restarted
replica), and the view is rebuilt from its replay, its AllBlocksCleared first. A replica
silent for ``CHECK_IDLE_S`` is asked again for its last batch, so a restart is noticed even
when its first batches went out before the SUB socket reconnected. A replica found dead has its
view replaced by an empty one (ReplicaSet.mark_dead): its feed stops, and starts over from
number 0 once the replica is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from runner.kv_events.schema import EventBatch, decode_batch
from runner.router.event_index import EventIndex
from runner.router.replicas import Replica

log = logging.getLogger(__name__)
POLL_MS = 100  # how often a quiet feed looks whether its replica's view was replaced
CHECK_IDLE_S = 1.0  # a replica silent this long is asked for its last batch again
REPLAY_TIMEOUT_MS = 2000  # a replay that goes this long without a frame is given up
REPLAY_ROUNDS = 16  # requests one catch-up makes (10,000 kept batches at 1,000 an answer: 10)
WILDCARDS = ("*", "0.0.0.0", "[::]")
Batches = list[tuple[int, EventBatch]]


@dataclass(frozen=True)
class Endpoints:
    endpoint: str
    replay_endpoint: str | None
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> Endpoints:
        """``ENDPOINT[,REPLAY_ENDPOINT]`` as `--kv-events-endpoint` gives them (every topic);
        ValueError naming what is wrong. Pure."""
        endpoint, _, replay = text.partition(",")
        for given in (endpoint, replay) if replay else (endpoint,):
            scheme, sep, rest = given.strip().partition("://")
            if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
                raise ValueError(f"not a ZeroMQ endpoint such as tcp://host:5557: {given!r}")
        return cls(endpoint.strip(), replay.strip() or None)


def endpoints_of(replica: Replica) -> Endpoints | None:
    """Where ``replica`` publishes its KV events, from its /kvcache/info (None: it does not,
    or its info is not read yet). A wildcard host is the host of the replica's URL. Pure."""
    events = (replica.info or {}).get("kv_events")
    if not isinstance(events, dict) or not isinstance(events.get("endpoint"), str):
        return None
    if events.get("binds") is False:
        return None  # it connects to a subscriber of its own (llm-d's): nothing to connect to
    host = urlsplit(replica.url).hostname or "127.0.0.1"
    replay = events.get("replay_endpoint")
    return Endpoints(
        _reached(events["endpoint"], host),
        _reached(replay, host) if isinstance(replay, str) and replay else None,
        str(events.get("topic") or ""),
    )


def _reached(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` as reached at ``host``; any other endpoint as it is. Pure."""
    scheme, sep, rest = endpoint.partition("://")
    where, colon, port = rest.rpartition(":")
    if scheme == "tcp" and sep and colon and where in WILDCARDS:
        return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
    return endpoint


class EventFeed:
    """Follows one replica's events into the view it has now, until that view is replaced
    (the replica was found dead) or the replica reports other endpoints."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        replica: Replica,
        locate: Callable[[Replica], Endpoints | None] = endpoints_of,
    ) -> None:
        endpoints = locate(replica)
        if endpoints is None:
            raise ValueError(f"{replica.name} reports no KV events endpoint")
        self.context, self.replica, self.endpoints = context, replica, endpoints
        self.locate = locate

    def _current(self, index: EventIndex) -> bool:
        return self.replica.index is index and self.locate(self.replica) == self.endpoints

    async def run(self) -> None:
        index = self.replica.index
        if not isinstance(index, EventIndex):
            return
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoints.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.endpoints.topic)
        try:
            # What it holds already (SUB queues what follows meanwhile); a view kept from
            # another publisher (the replica came back on another port) starts over.
            await self._check(index)
            quiet = 0
            while self._current(index):
                if not await sub.poll(POLL_MS):
                    quiet += POLL_MS
                    if quiet >= CHECK_IDLE_S * 1000:
                        quiet = 0
                        await self._check(index)
                    continue
                quiet = 0
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue  # not a KV event message
                try:
                    batch = decode_batch(frames[2])
                except msgspec.MsgspecError:
                    log.warning("%s: a KV event batch does not decode", self.replica.name)
                    continue
                await self._receive(index, int.from_bytes(frames[1], "big"), batch)
        finally:
            sub.close()

    async def _receive(self, index: EventIndex, seq: int, batch: EventBatch) -> None:
        if seq <= index.last_seq:
            if batch.ts <= index.last_ts:
                return  # applied already (a replay overlapped the stream)
            index.restart()  # numbers started over, with later events: a new publisher
            await self._catch_up(index, 0)
        elif seq > index.last_seq + 1:
            await self._catch_up(index, index.last_seq + 1)  # the batches it skipped
        if seq > index.last_seq:  # a gap no replay filled is applied over: the view goes on
            index.apply(seq, batch)

    async def _catch_up(self, index: EventIndex, start: int) -> None:
        """Apply the replay's batches from ``start`` on that the view lacks: asked again from
        the next number while answers bring new ones (a publisher answers a bounded share a
        request: runner/kv_events/replay.py), at most REPLAY_ROUNDS times."""
        for _ in range(REPLAY_ROUNDS):
            fresh = [(s, b) for s, b in await self._replay(start) or [] if s > index.last_seq]
            for seq, batch in fresh:
                index.apply(seq, batch)
            if not fresh:
                return
            start = index.last_seq + 1

    async def _check(self, index: EventIndex) -> None:
        """Ask for the last batch applied again: a publisher that does not answer it with the
        same batch started over since (a replica restarted while its stream was quiet)."""
        if index.last_seq < 0:
            await self._catch_up(index, 0)
            return
        batches = await self._replay(index.last_seq)
        if batches is None:
            return  # no replay socket, or no answer: nothing learned
        first = (batches[0][0], batches[0][1].ts) if batches else None
        if first != (index.last_seq, index.last_ts):
            index.restart()
            await self._catch_up(index, 0)
        else:
            for seq, batch in batches[1:]:
                if seq > index.last_seq:
                    index.apply(seq, batch)

    async def _replay(self, start: int) -> Batches | None:
        """The publisher's batches from number ``start`` on, as its replay socket sends them
        (vLLM's protocol: ``[b"", start]`` from a DEALER, answered ``[b"", seq, payload]``
        each, then ``seq`` -1); None without a replay socket or a whole answer."""
        if self.endpoints.replay_endpoint is None:
            return None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoints.replay_endpoint)
        out: Batches = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(REPLAY_TIMEOUT_MS):
                frames = await dealer.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else -1
                if seq < 0:
                    return out
                with contextlib.suppress(msgspec.MsgspecError):
                    out.append((seq, decode_batch(frames[-1])))
            return None
        finally:
            dealer.close()


class EventFeeds:
    """A feed per replica, from the router's start to its end: each follows its replica's
    events while the replica is up and reports endpoints, and starts over when it comes back."""

    def __init__(
        self,
        replicas: list[Replica],
        interval_s: float,
        given: dict[str, Endpoints] | None = None,
    ) -> None:
        self.replicas = replicas
        self.interval_s = interval_s
        self.given = dict(given or {})  # --kv-events-endpoint: replica URL -> its endpoints
        self._warned: set[str] = set()

    def locate(self, replica: Replica) -> Endpoints | None:
        """Its endpoints as given by flag, else as its /kvcache/info reports them."""
        return self.given.get(replica.url) or endpoints_of(replica)

    async def run(self) -> None:
        context = zmq.asyncio.Context()
        try:
            await asyncio.gather(*(self._follow(context, r) for r in self.replicas))
        finally:
            context.destroy(linger=0)

    async def _follow(self, context: zmq.asyncio.Context, replica: Replica) -> None:
        while True:
            endpoints = self.locate(replica)
            if endpoints is None and replica.info is not None and replica.url not in self._warned:
                self._warned.add(replica.url)
                log.warning("%s publishes no KV events: routed by load alone", replica.name)
            if replica.healthy and endpoints is not None:
                try:
                    await EventFeed(context, replica, self.locate).run()
                except zmq.ZMQError as err:  # a bad endpoint: tried again next interval
                    log.warning("%s: KV events: %s", replica.name, err)
                except Exception:  # noqa: BLE001 - one replica's feed must not stop the others
                    log.exception(
                        "%s: KV events: the feed failed; following it again", replica.name
                    )
            await asyncio.sleep(self.interval_s)
