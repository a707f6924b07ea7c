"""A worker's extra routes for its role, on the `kvcache serve` app (runner/serve/app.py):

* prefill: POST /kvcache/prefill/v1/completions and /kvcache/prefill/v1/chat/completions take
  the client's body, run it with max_tokens 1 (the prompt and its first token) and answer the
  kv_transfer_params a decode worker pulls with. With ``?early=1`` (the direct transport) the
  answer is two JSON lines: the params of the open handover as soon as the request is queued
  (a decode worker may pull while the prefill runs), then the whole answer; a failure after the
  first line is a last line ``{"error": ...}``. POST /kvcache/release frees a handover that
  will not be pulled.
* decode: POST /kvcache/pull takes those params and pulls the blocks (before the router sends
  the request itself to /v1/...).
* both roles: GET /kvcache/disagg, what the handovers did; GET /kvcache/metrics, the
  engine's recorded steps and requests (an engine made with record_metrics, as the bench's
  workers are) with the wall-clock time its step times count from, so two workers' schedules
  can be drawn on one timeline (`kvcache report`).

With --api-key every one of them takes the server's key (they are guarded here too, so they
stay guarded on any app the role is attached to); /health stays open, and says 503 when the
handover's thread is gone. A URL they show has its password masked (kvcache.redaction).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.middleware.base import RequestResponseEndpoint

from kvcache.redaction import redact_url
from runner.disagg.roles import RoleParts
from runner.engine.api.interface import EngineInterface
from runner.engine.sequence import Sequence
from runner.serve.app import admit  # the server's own checks: draining, model, 400, 429
from runner.serve.auth import key_matches, unauthorized
from runner.serve.calls import Call, CallError
from runner.serve.events import Submission
from runner.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# Fields of the client's body a prefill does not take: it answers once, with one sample.
_PREFILL_DROPPED = (
    "stream_options",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "best_of",
)
# Every route of a role's but /health: with --api-key they take the server's key. The info
# route names the handover's URL (its password masked) and what the handovers did; metrics
# say what the worker ran.
_GUARDED = (
    "/kvcache/prefill/", "/kvcache/pull", "/kvcache/release", "/kvcache/disagg", "/kvcache/metrics",
)  # fmt: skip


def prefill_body(kind: str, raw: dict[str, Any]) -> SamplingFields:
    """The client's body as a prefill runs it: max_tokens 1, not streamed, one sample.
    Raises CallError 400 naming the problem."""
    if not isinstance(raw, dict):
        raise CallError(400, "the body must be a JSON object", "invalid_request_error")
    body = {k: v for k, v in raw.items() if k not in _PREFILL_DROPPED}
    body |= {"max_tokens": 1, "stream": False, "n": 1}
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        parsed = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        raise CallError(400, message, "invalid_request_error", param) from err
    if isinstance(parsed, CompletionRequest) and len(parsed.prompts()) != 1:
        message = "a disaggregated completion takes one prompt"
        raise CallError(400, message, "invalid_request_error", "prompt")
    return parsed


def attach_role(app: FastAPI, parts: RoleParts) -> None:
    """Add the role's routes to a `kvcache serve` app. With --api-key they take the same key
    as /v1/*."""
    state = app.state.serve
    publisher, puller = parts.publisher, parts.puller

    @app.middleware("http")
    async def guard(request: Request, call_next: RequestResponseEndpoint) -> Response:
        """The API key on the role's routes; /health says 503 when the handover's thread is
        gone (a router then sends the worker nothing: its handovers would all be computed)."""
        key, path = state.settings.api_key, request.url.path
        if key is not None and path.startswith(_GUARDED):
            # key_matches: Bearer in any case, compared in constant time (hmac.compare_digest)
            if not key_matches(request.headers.get("authorization"), key):
                return unauthorized()
        if path == "/health" and publisher is not None and not publisher.alive:
            return JSONResponse({"status": "handover server down"}, 503)
        return await call_next(request)

    async def prefill(kind: str, raw: dict[str, Any], request: Request) -> Response:
        if publisher is None:
            raise CallError(404, "this worker is not a prefill worker", "invalid_request_error")
        body = prefill_body(kind, raw)
        params = await admit(state, body, 1)
        salt = body.cache_salt
        opened: list[list[int]] = []  # the prompt's token ids, once its handover is open

        def open_handover(seqs: list[Sequence]) -> None:
            """The queued prompt's handover opens before its first step, and fills as its
            blocks commit (on the engine's thread: Submission.on_queued)."""
            tokens = list(seqs[0].prompt_token_ids)
            publisher.open(call.id, tokens, salt)
            opened.append(tokens)

        if isinstance(body, ChatCompletionRequest):
            sub = Submission(
                "", 0, params, messages=body.template_messages(),
                template_kwargs=body.chat_template_kwargs, cache_salt=salt,
                on_queued=open_handover,
            )  # fmt: skip
        else:
            assert isinstance(body, CompletionRequest)
            prompt = body.prompts()[0]
            sub = Submission("", 0, params, prompt=prompt, cache_salt=salt, on_queued=open_handover)
        call = Call(state.engine, request, [sub], "messages" if kind == "chat" else "prompt")
        sub.request_id = f"{call.id}-0"
        await call.start()  # Accepted comes after the hook ran
        early = None
        if opened:  # (off the event loop: over Redis, the marker's round trip)
            early = await asyncio.to_thread(publisher.announce, call.id, opened[0], salt)

        async def answer() -> dict[str, Any]:
            try:
                (output,) = await call.outputs()
            except BaseException:
                if early is not None:
                    publisher.release(call.id)
                raise
            tokens = output.prompt_token_ids
            kv = await asyncio.to_thread(publisher.publish, call.id, tokens, salt)
            first = output.outputs[0]
            usage = {"prompt_tokens": len(tokens), "cached_tokens": output.num_cached_tokens}
            done = {"id": call.id, "text": first.text, "token_ids": list(first.token_ids)}
            return {"kv_transfer_params": kv, "prefill": done | usage}

        if request.query_params.get("early") != "1" or early is None:
            return JSONResponse(await answer())

        async def lines() -> AsyncIterator[bytes]:
            yield (json.dumps({"kv_transfer_params": early}) + "\n").encode()
            try:
                yield (json.dumps(await answer()) + "\n").encode()
            except CallError as err:
                yield (json.dumps(err.body) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/kvcache/prefill/v1/completions")
    async def prefill_completion(raw: dict[str, Any], request: Request) -> Response:
        return await prefill("completion", raw, request)

    @app.post("/kvcache/prefill/v1/chat/completions")
    async def prefill_chat(raw: dict[str, Any], request: Request) -> Response:
        return await prefill("chat", raw, request)

    @app.post("/kvcache/release")
    async def release(raw: dict[str, Any]) -> JSONResponse:
        if publisher is None:
            raise CallError(404, "this worker is not a prefill worker", "invalid_request_error")
        handover_id = raw.get("handover_id") if isinstance(raw, dict) else None
        if not isinstance(handover_id, str):
            raise CallError(400, "handover_id: a string", "invalid_request_error", "handover_id")
        return JSONResponse({"released": publisher.release(handover_id)})

    @app.post("/kvcache/pull")
    async def pull(raw: dict[str, Any]) -> JSONResponse:
        if puller is None:
            raise CallError(404, "this worker is not a decode worker", "invalid_request_error")
        if state.draining:
            raise CallError(503, "the server is shutting down", "service_unavailable")
        try:
            loop = asyncio.get_running_loop()  # the puller's own threads: a pull waits long
            return JSONResponse(await loop.run_in_executor(puller.executor, puller.pull, raw))
        except ValueError as err:
            raise CallError(400, str(err), "invalid_request_error") from err

    @app.get("/kvcache/metrics")
    async def metrics() -> JSONResponse:
        llm = parts.llm
        if llm is None or not llm.config.record_metrics:
            raise CallError(404, "this worker records no metrics", "invalid_request_error")
        return JSONResponse(await asyncio.to_thread(worker_metrics, llm))

    @app.get("/kvcache/disagg")
    async def disagg() -> dict[str, Any]:
        handover = redact_url(parts.options.handover)  # never the Redis password
        out: dict[str, Any] = {"role": parts.options.role, "handover": handover}
        if publisher is not None:
            out["published"] = publisher.stats()
        if puller is not None:
            out["pulled"] = puller.stats()
        return out


def worker_metrics(llm: EngineInterface) -> dict[str, Any]:
    """``llm.metrics()`` with ``t0_unix_s``: the wall-clock time its ``t_start_s`` count from."""
    out = llm.metrics()
    out["t0_unix_s"] = time.time() - (time.perf_counter() - llm.metrics_t0)
    return out
