"""The replicas behind a router: each one's URL, whether it answers its health check, how
many requests (and blocks of work) it has in flight from this router, and how it names its
cache blocks (its model fingerprint and block size, read from its /kvcache/info), and what it
caches: what was routed to it, or what its KV events say (`kvcache router --kv-events`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvcache.redaction import redact_url
from runner.router.event_index import EventIndex
from runner.router.prefix_index import PrefixIndex

HEALTH_TIMEOUT_S = 2.0


@dataclass
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0
    sent: int = 0  # requests routed here, retries included
    load_blocks: int = 0  # KV blocks of work in flight from this router (runner/router/load.py)
    info: dict[str, Any] | None = None  # its /kvcache/info, once read
    # What it caches: what was sent to it (PrefixIndex), or what its KV events say (EventIndex)
    index: PrefixIndex | EventIndex = field(default_factory=PrefixIndex)

    @property
    def name(self) -> str:
        """The URL as shown on /router/stats, /metrics and in the logs: a password in it
        (`http://admin:pw@host`) as `***` (kvcache/redaction.py), since those routes answer
        without the router's key."""
        return redact_url(self.url)

    @property
    def naming(self) -> BlockNaming | None:
        """How it names its cache blocks, or None while that is not known (its info not read
        yet, or lacking a usable fingerprint or block size: it is then counted as holding no
        known prefix)."""
        return block_naming(self.info)


@dataclass(frozen=True)
class BlockNaming:
    """What a replica's block hashes depend on: its model fingerprint and block size."""

    fingerprint: str
    block_size: int


def block_naming(info: Mapping[str, object] | None) -> BlockNaming | None:
    """The naming a replica's /kvcache/info gives: a non-empty fingerprint string and a
    positive integer block size; None for anything else (a replica that leaves them out or
    gives `block_size: 0` must not fail the requests routed among it and the others). Pure."""
    if info is None:
        return None
    fingerprint, block_size = info.get("fingerprint"), info.get("block_size")
    if not isinstance(fingerprint, str) or not fingerprint:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        return None
    return BlockNaming(fingerprint, block_size)


class ReplicaSet:
    """The replicas, and the health loop that takes a dead one out and puts it back once it
    answers again."""

    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        interval_s: float,
        kv_events: bool = False,
    ) -> None:
        if not urls:
            raise ValueError("a router needs at least one --replica")
        if len(set(urls)) != len(urls):
            raise ValueError("a --replica is given twice")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        if kv_events:  # each one's view is built from its KV events (event_feed.py)
            for replica in self.replicas:
                replica.index = EventIndex(name=replica.name)
        self.client = client
        self.interval_s = interval_s

    def healthy(self, exclude: frozenset[str] | set[str] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.url not in exclude]

    def mark_dead(self, replica: Replica) -> None:
        """It refused a connection, closed one without answering, died mid-answer or is
        draining: out of rotation until its health check passes again, and what the prefix
        index believes it holds is forgotten. A replica that went away comes back with an empty
        cache: kept, its old prefixes drew every request there (336 of 336 for a minute after
        a restart, issue 42) to compute them afresh."""
        replica.healthy = False
        replica.index = replica.index.emptied()

    def mark_silent(self, replica: Replica) -> None:
        """It kept silent past an upstream timeout: out of rotation until its health check
        passes again (a replica whose engine hung while its HTTP side answers comes back at its
        next check, and is taken out again by the next request that times out). Its index is
        kept: a slow replica still holds its cache, and one that restarts meanwhile refuses a
        connection first."""
        replica.healthy = False

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def check(self, replica: Replica) -> None:
        """One health check. A replica that refuses the connection (down, restarting) or
        answers 503 (draining: about to go) is marked dead, its prefix index forgotten. One
        that comes back (or up) has its /kvcache/info read afresh; its prefix index is emptied
        if it now names blocks otherwise (another model or block size). A slow health check
        under load (a timeout) must not cost the index."""
        url = replica.url
        try:
            resp = await self.client.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)
            ok = resp.is_success
            if resp.status_code == 503:
                self.mark_dead(replica)
            if ok and not replica.healthy:
                resp = await self.client.get(f"{url}/kvcache/info", timeout=HEALTH_TIMEOUT_S)
                info = resp.json() if resp.is_success else None
                if not isinstance(info, dict):  # a list, a number: nothing known of it
                    info = None
                if block_naming(info) != replica.naming:
                    replica.index = replica.index.emptied()
                replica.info = info
        except httpx.TimeoutException:
            ok = False
        except httpx.TransportError:
            ok = False
            self.mark_dead(replica)
        except (httpx.HTTPError, ValueError):
            ok = False
        replica.healthy = ok

    async def run_health_checks(self) -> None:
        """Forever: every interval, each replica's /health (cancelled at shutdown)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()
