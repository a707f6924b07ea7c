"""The router's FastAPI app: OpenAI's POST routes forwarded to the replica the policy picks
(streams passed through event by event as they arrive, runner/router/relay.py), retried on
another replica when the chosen one cannot be reached, is draining, or stays silent past the
first-output timeout before it answered; /v1/models from a healthy replica; /health;
/router/stats (JSON) and Prometheus /metrics. A replica that fails once it answered ends the
client's stream with an error event (a whole answer: 502, or 504 when it went silent)."""

from __future__ import annotations

import asyncio
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvcache.redaction import redact_url
from runner.router.bodies import read_body
from runner.router.event_feed import Endpoints, EventFeeds
from runner.router.event_index import EventIndex
from runner.router.load import Work, answer_blocks
from runner.router.policy import policy_for
from runner.router.prefix_index import PrefixIndex
from runner.router.prompt_hashes import PromptHasher, replica_hashes
from runner.router.proxy import RouterSettings, forwarded_headers, proxy_app, upstream_client
from runner.router.relay import Hooks, Timeouts, UpstreamSilent, post, relay
from runner.router.replicas import Replica, ReplicaSet
from runner.router.worker_choice import PromptTokens
from runner.serve.json_types import JSONBody
from runner.serve.responses import error_body

PASSED_BACK_HEADERS = ("retry-after",)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "kvcache_router_requests",
            "Requests routed, by replica and reason",
            ["replica", "reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvcache_router_retries", "Requests retried on another replica", registry=self.registry
        )


class Router:
    """The replicas, the policy, and the tokenizer the cache-aware policy hashes prompts with."""

    def __init__(self, urls: list[str], settings: RouterSettings, client: httpx.AsyncClient):
        self.settings = settings
        self.policy = policy_for(settings)
        self.replicas = ReplicaSet(urls, client, settings.health_interval_s, settings.kv_events)
        given = {
            url.rstrip("/"): Endpoints.parse(text)
            for url, text in settings.kv_events_endpoints.items()
        }
        unknown = sorted(set(given) - {r.url for r in self.replicas.replicas})
        if unknown:
            named = ", ".join(redact_url(url) for url in unknown)
            raise ValueError(f"--kv-events-endpoint names no --replica: {named}")
        self.feeds = EventFeeds(self.replicas.replicas, settings.health_interval_s, given)
        self.client = client
        self.timeouts = Timeouts.of(settings)
        self.prompt_tokens = PromptTokens(settings.tokenizer)
        self.metrics = RouterMetrics()
        self.reasons: dict[str, int] = {}

    async def load_tokenizer(self) -> None:
        """The prompts' tokenizer (cache_aware only): --tokenizer, else the folder the first
        replica that answers reports for its model (same machine)."""
        if self.policy.uses_prefixes:
            # None: no replica is up yet (tried again on the next request), or it cannot be
            # loaded (warned once: the requests then go to the least loaded replica)
            await self.prompt_tokens.load(self.replicas.replicas)

    @property
    def hasher(self) -> PromptHasher | None:
        return self.prompt_tokens.hasher

    async def forward(self, path: str, request: Request) -> Response:
        raw, body = await read_body(request)  # else a 400 (runner/router/bodies.py)
        token_ids = None
        if self.policy.uses_prefixes:
            token_ids = await self.prompt_tokens.of(path, body, self.replicas.replicas)
        salt = body.get("cache_salt")
        headers = forwarded_headers(request, self.settings)
        hashes_of = replica_hashes(self.hasher, token_ids, salt)

        tried: set[str] = set()
        for _ in range(self.settings.max_attempts):
            candidates = self.replicas.healthy(exclude=tried)
            if not candidates:
                break
            route = self.policy.choose(candidates, hashes_of)
            replica = route.replica
            if self.policy.uses_prefixes:
                replica.index.insert(hashes_of(replica))
            work = Work(replica, route.prefill_blocks, answer_blocks(body, replica))
            sent_at = time.monotonic()
            response = await self._send(work, path, raw, headers)
            if response is None:
                tried.add(replica.url)
                self.metrics.retries.inc()
                continue
            self.metrics.routed.labels(replica=replica.name, reason=route.reason).inc()
            self.reasons[route.reason] = self.reasons.get(route.reason, 0) + 1
            return await relay(
                response, sent_at, self.timeouts, self._hooks(work), _passed_back(response)
            )
        message = "no replica could take the request (all are down, draining or timed out)"
        return JSONResponse(error_body(message, "service_unavailable"), 503)

    async def _send(
        self, work: Work, path: str, raw: bytes, headers: dict[str, str]
    ) -> httpx.Response | None:
        """The replica's response, its body not read yet; None when it must be retried
        elsewhere: unreachable or closed without answering (marked dead: its prefix index is
        forgotten), silent past the first-output timeout (out until its health check passes),
        or draining."""
        replica = work.replica
        work.start()
        try:
            response = await post(self.client, replica.url + path, self.timeouts, headers, raw)
        except (httpx.TransportError, UpstreamSilent) as err:
            work.finish()
            self._failed(replica, err)
            return None
        if response.status_code == 503:
            await response.aclose()
            work.finish()
            self.replicas.mark_dead(replica)  # draining: back once its /health says ok
            return None
        return response

    def _failed(self, replica: Replica, err: Exception) -> None:
        if isinstance(err, UpstreamSilent):
            self.replicas.mark_silent(replica)
        else:
            self.replicas.mark_dead(replica)

    def _hooks(self, work: Work) -> Hooks:
        return Hooks(
            "the replica",
            work.prefilled,
            work.finish,
            lambda err: self._failed(work.replica, err),
        )

    def stats(self) -> JSONBody:
        return {
            "policy": self.settings.policy,
            "reasons": dict(self.reasons),
            "replicas": [
                {
                    "url": r.name,
                    "healthy": r.healthy,
                    "in_flight": r.in_flight,
                    "sent": r.sent,
                    "load_blocks": r.load_blocks,
                    "indexed_blocks": len(r.index),
                }
                | _events_stats(r.index)
                for r in self.replicas.replicas
            ],
        }


def _events_stats(index: PrefixIndex | EventIndex) -> JSONBody:
    """A view fed by KV events: its blocks per medium and the last batch's number."""
    if not isinstance(index, EventIndex):
        return {}
    return {
        "kv_events": {
            "last_seq": index.last_seq,
            "blocks": index.counts(),
            "forgotten_blocks": index.forgotten,  # past its capacity, least recent first
            "ignored_events": index.ignored,  # of a medium other than GPU, CPU and DISK
        }
    }


def _passed_back(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() in PASSED_BACK_HEADERS}


def build_router_app(urls: list[str], settings: RouterSettings) -> FastAPI:
    """The app routing over `urls`; its health loop runs from startup to shutdown."""
    client = upstream_client(settings)
    router = Router(urls, settings, client)

    async def start() -> None:
        await router.replicas.check_all()
        await router.load_tokenizer()

    async def health_loop() -> None:
        """The health checks, and with --kv-events the replicas' event feeds beside them."""
        if settings.kv_events:
            await asyncio.gather(router.replicas.run_health_checks(), router.feeds.run())
        else:
            await router.replicas.run_health_checks()

    app = proxy_app("kvcache router", router, client, start, health_loop, settings.api_key)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for replica in router.replicas.healthy():
            headers = forwarded_headers(request, settings)
            headers.pop("content-type", None)
            try:
                resp = await client.get(f"{replica.url}/v1/models", headers=headers)
            except httpx.TransportError:
                continue
            return Response(resp.content, resp.status_code, media_type="application/json")
        return JSONResponse(error_body("no replica is up", "service_unavailable"), 503)

    @app.get("/health")
    async def health() -> Response:
        up = len(router.replicas.healthy())
        return JSONResponse(
            {"status": "ok" if up else "down", "replicas_up": up}, 200 if up else 503
        )

    @app.get("/router/stats", response_model=None)
    async def stats() -> JSONBody:
        return router.stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type="text/plain")

    return app
