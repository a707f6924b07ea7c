"""What both routers share (the replicas' `kvcache router` and the prefill/decode one): their
settings, the upstream client, the headers a client's request passes on, and the app whose
OpenAI routes go through a router's ``forward``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from runner.router.bodies import BadBody
from runner.serve.auth import require_api_key
from runner.serve.responses import error_body

FORWARDED_HEADERS = ("authorization", "content-type", "accept")


@dataclass
class RouterSettings:
    policy: str = "cache_aware"
    threshold: float = 0.0
    balance_abs: int = 64
    balance_rel: float = 1.5
    health_interval_s: float = 1.0
    tokenizer: str | None = None  # default: the first replica's model folder
    max_attempts: int = 3
    # Upstream timeouts (runner/router/relay.py): connecting; from a request to its first
    # generated text (or its whole answer, not streamed); the longest silence in a stream after
    # it. 600 s each but the connection, as the one timeout was before they had flags.
    connect_timeout_s: float = 5.0
    first_output_timeout_s: float = 600.0
    idle_timeout_s: float = 600.0
    api_key: str | None = None  # what the router's own clients must send
    replica_api_key: str | None = None  # what the router sends the replicas, instead of theirs
    load_weight: float = 1.0  # cache_aware: a block of work in flight against a block matched
    recent_half_life_s: float = 120.0  # cache_aware: how fast conversations started are forgotten
    # cache_aware: each replica's cache as its KV events say (runner/router/event_feed.py),
    # instead of what was routed to it
    kv_events: bool = False
    # --kv-events-endpoint: replica URL -> "ENDPOINT[,REPLAY]" (else its /kvcache/info's)
    kv_events_endpoints: dict[str, str] = field(default_factory=dict)


class Forwarder(Protocol):
    async def forward(self, path: str, request: Request) -> Response: ...


def forwarded_headers(request: Request, settings: RouterSettings) -> dict[str, str]:
    """The client's headers a replica gets. The client's Authorization goes along only when
    the router has no key of its own for the replicas: then one key (the router's, if it has
    one) serves both hops, as a single --api-key does in SGLang's router."""
    names: tuple[str, ...] = FORWARDED_HEADERS
    if settings.replica_api_key is not None:
        names = tuple(name for name in names if name != "authorization")
    return {k: v for k, v in request.headers.items() if k.lower() in names}


def upstream_client(settings: RouterSettings) -> httpx.AsyncClient:
    """The one client a router's upstream calls share; with a replica key, every call it
    makes carries it (requests, health checks, /kvcache/info, /v1/models)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(settings.first_output_timeout_s, connect=settings.connect_timeout_s)
    headers = {}
    if settings.replica_api_key is not None:
        headers["authorization"] = f"Bearer {settings.replica_api_key}"
    return httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers)


def proxy_app(
    title: str,
    router: Forwarder,
    client: httpx.AsyncClient,
    start: Callable[[], Awaitable[None]],
    health_loop: Callable[[], Coroutine[object, object, None]],
    api_key: str | None = None,
) -> FastAPI:
    """An app whose OpenAI routes go through `router`: `start` runs at startup, the health
    loop from then to shutdown, and the client closes last. With `api_key`, its /v1/* routes
    answer 401 to a client without it, as `kvcache serve --api-key` does. Every error it
    answers itself is in OpenAI's shape: a bad body a 400 naming the problem, an unknown
    route its 404/405, anything unexpected a 500 (its traceback goes to the log only)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await start()
        health = asyncio.create_task(health_loop())
        yield
        health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await health
        await client.aclose()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.router = router
    require_api_key(app, api_key)

    @app.exception_handler(BadBody)
    async def bad_body(request: Request, err: BadBody) -> Response:
        return JSONResponse(error_body(err.message, "invalid_request_error", err.param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        body = error_body(str(err.detail), "invalid_request_error")
        return JSONResponse(body, err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception) -> Response:
        message = f"the router failed on this request ({type(err).__name__}); see its log"
        return JSONResponse(error_body(message, "server_error"), 500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward("/v1/chat/completions", request)

    return app
