"""The API key a server or a router asks its own clients for: `Authorization: Bearer KEY` on
every /v1/* route, else a 401 in OpenAI's error shape. /health, /metrics and the kvcache
routes stay open (as vLLM's --api-key leaves them): load balancers, scrapers and a router's
health checks hold no key."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runner.serve.responses import error_body

GUARDED_PREFIX = "/v1/"


def require_api_key(app: FastAPI, key: str | None) -> None:
    """With a key, every /v1/* request must carry it; without one, nothing is checked."""
    if key is None:
        return
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def api_key(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith(GUARDED_PREFIX):
            given = request.headers.get("authorization", "").encode()
            # compare_digest: the time taken says nothing about how much of the key matched
            if not hmac.compare_digest(given, expected):
                message = "invalid or missing API key"
                body = error_body(message, "invalid_request_error", None, "invalid_api_key")
                return JSONResponse(body, 401)
        return await call_next(request)
