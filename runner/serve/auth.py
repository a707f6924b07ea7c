"""The API key a server or a router asks its own clients for: `Authorization: Bearer KEY`
(the scheme in any case, as RFC 9110 makes it), else a 401 in OpenAI's error shape.

Which paths need the key is the app's choice (`Guarded`): `kvcache serve` guards everything
but its health checks (`ALL_BUT_HEALTH`: /kvcache/* tells a client the handover URL, the model
folder, the load; /metrics too, since Prometheus can send a bearer token), while the routers
keep vLLM's narrower choice (`V1_ROUTES`) until they say otherwise. `key_matches` is the one
comparison, for any middleware that checks the key itself (the disaggregation routes)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.base import RequestResponseEndpoint

from runner.serve.responses import error_body


@dataclass(frozen=True)
class Guarded:
    """The paths that need the key: those under `prefix`, but for the `open` ones (exact
    paths, so /health/../x is not one of them)."""

    prefix: str
    open: frozenset[str] = frozenset()

    def needs_key(self, path: str) -> bool:
        return path.startswith(self.prefix) and path not in self.open


V1_ROUTES = Guarded("/v1/")
ALL_BUT_HEALTH = Guarded("/", frozenset({"/health", "/ping"}))


def key_matches(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header value is `Bearer <key>` (`bearer`, `BEARER`: the
    scheme is case-insensitive). The keys are compared as SHA-256 digests with
    compare_digest: the time taken says nothing of how much of the key, or its length,
    matched."""
    if authorization is None or not key:  # an empty key is no key anyone holds
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Starlette decodes header bytes as latin-1: encoding back gives the bytes sent.
    given = hashlib.sha256(token.strip().encode("latin-1", "replace")).digest()
    expected = hashlib.sha256(key.encode()).digest()
    return hmac.compare_digest(given, expected)


def unauthorized() -> JSONResponse:
    """The 401 every keyed route answers a client without the key."""
    message = "invalid or missing API key"
    return JSONResponse(error_body(message, "invalid_request_error", None, "invalid_api_key"), 401)


def require_api_key(app: FastAPI, key: str | None, guarded: Guarded = V1_ROUTES) -> None:
    """With a key, every request to a `guarded` path must carry it; without one, nothing is
    checked. An empty key (an unset $SECRET) is a ValueError, never an open door."""
    if key is None:
        return
    if not key.strip():
        raise ValueError("api_key is empty: give a key, or None for no key")

    @app.middleware("http")
    async def api_key(request: Request, call_next: RequestResponseEndpoint) -> Response:
        if guarded.needs_key(request.url.path):
            if not key_matches(request.headers.get("authorization"), key):
                return unauthorized()
        return await call_next(request)
