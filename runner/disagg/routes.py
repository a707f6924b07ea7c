"""A worker's extra routes for its role, on the `kvcache serve` app:

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
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.middleware.base import RequestResponseEndpoint

from kvcache.redaction import redact_url
from runner.disagg.publish import Publisher
from runner.disagg.pull import Puller
from runner.disagg.roles import RoleParts
from runner.engine.api.interface import ServingEngine
from runner.engine.sequence import Sequence
from runner.serve.app import admit  # the server's own checks: draining, model, 400, 429
from runner.serve.auth import key_matches, unauthorized
from runner.serve.calls import Call, CallError
from runner.serve.events import Submission
from runner.serve.json_types import JSONBody
from runner.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from runner.serve.state import ServerState

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


def prefill_body(kind: str, raw: dict[str, object]) -> SamplingFields:
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
    state: ServerState = app.state.serve
    guard_role_routes(app, state, parts.publisher)
    add_prefill_routes(app, state, parts.publisher)
    add_pull_route(app, state, parts.puller)
    add_info_routes(app, parts)


def guard_role_routes(app: FastAPI, state: ServerState, publisher: Publisher | None) -> None:
    """The API key on the role's routes; /health says 503 when the handover's thread is gone
    (a router then sends the worker nothing: its handovers would all be computed)."""

    @app.middleware("http")
    async def guard(request: Request, call_next: RequestResponseEndpoint) -> Response:
        key, path = state.settings.api_key, request.url.path
        if key is not None and path.startswith(_GUARDED):
            # key_matches: Bearer in any case, compared in constant time (hmac.compare_digest)
            if not key_matches(request.headers.get("authorization"), key):
                return unauthorized()
        if path == "/health" and publisher is not None and not publisher.alive:
            return JSONResponse({"status": "handover server down"}, 503)
        return await call_next(request)


def add_prefill_routes(app: FastAPI, state: ServerState, publisher: Publisher | None) -> None:
    """The prefill worker's routes: its two endpoints and the release of a handover."""

    @app.post("/kvcache/prefill/v1/completions")
    async def prefill_completion(raw: dict[str, object], request: Request) -> Response:
        return await run_prefill(state, prefill_worker(publisher), "completion", raw, request)

    @app.post("/kvcache/prefill/v1/chat/completions")
    async def prefill_chat(raw: dict[str, object], request: Request) -> Response:
        return await run_prefill(state, prefill_worker(publisher), "chat", raw, request)

    @app.post("/kvcache/release")
    async def release(raw: dict[str, object]) -> JSONResponse:
        publisher_ = prefill_worker(publisher)
        handover_id = raw.get("handover_id") if isinstance(raw, dict) else None
        if not isinstance(handover_id, str):
            raise CallError(400, "handover_id: a string", "invalid_request_error", "handover_id")
        return JSONResponse({"released": publisher_.release(handover_id)})


def prefill_worker(publisher: Publisher | None) -> Publisher:
    if publisher is None:
        raise CallError(404, "this worker is not a prefill worker", "invalid_request_error")
    return publisher


async def run_prefill(
    state: ServerState, publisher: Publisher, kind: str, raw: dict[str, object], request: Request
) -> Response:
    """One prefill: the body checked and admitted, its prompt queued with its handover open,
    then the answer whole, or (``?early=1``) the open handover's params first."""
    body = prefill_body(kind, raw)
    handover = PrefillHandover(publisher, body.cache_salt)
    sub = await admitted_submission(state, body, handover.open)
    call = Call(state.engine, request, [sub], "messages" if kind == "chat" else "prompt")
    sub.request_id = f"{call.id}-0"
    handover.id = call.id
    await call.start()  # Accepted comes after the hook ran
    await handover.announce()
    if request.query_params.get("early") != "1" or handover.early is None:
        return JSONResponse(await handover.answer(call))
    return StreamingResponse(handover.lines(call), media_type="application/x-ndjson")


async def admitted_submission(
    state: ServerState, body: SamplingFields, on_queued: Callable[[list[Sequence]], None]
) -> Submission:
    """The prefill's one submission, admitted by the server's own checks: the conversation or
    the one prompt, `on_queued` called on the engine's thread once it is queued."""
    params = await admit(state, body, 1)
    salt = body.cache_salt
    if isinstance(body, ChatCompletionRequest):
        return Submission(
            "", 0, params, messages=body.template_messages(),
            template_kwargs=body.chat_template_kwargs, cache_salt=salt, on_queued=on_queued,
        )  # fmt: skip
    assert isinstance(body, CompletionRequest)
    prompt = body.prompts()[0]
    return Submission("", 0, params, prompt=prompt, cache_salt=salt, on_queued=on_queued)


class PrefillHandover:
    """A prefill's handover: opened before the prompt's first step, filled as its blocks commit,
    announced (the direct transport's early params) and published once the prefill is done."""

    def __init__(self, publisher: Publisher, cache_salt: str | None) -> None:
        self.publisher, self.salt = publisher, cache_salt
        self.id = ""  # the call's id, set before it starts
        self.opened: list[list[int]] = []  # the prompt's token ids, once the handover is open
        self.early: JSONBody | None = None

    def open(self, seqs: list[Sequence]) -> None:
        """On the engine's thread, when the prompt is queued (Submission.on_queued)."""
        tokens = list(seqs[0].prompt_token_ids)
        self.publisher.open(self.id, tokens, self.salt)
        self.opened.append(tokens)

    async def announce(self) -> None:
        if self.opened:  # (off the event loop: over Redis, the marker's round trip)
            self.early = await asyncio.to_thread(
                self.publisher.announce, self.id, self.opened[0], self.salt
            )

    async def answer(self, call: Call) -> JSONBody:
        """The prefill's answer with its published handover's params; the handover released
        when the prefill fails after it was announced."""
        try:
            (output,) = await call.outputs()
        except BaseException:
            if self.early is not None:
                self.publisher.release(call.id)
            raise
        tokens = output.prompt_token_ids
        kv = await asyncio.to_thread(self.publisher.publish, call.id, tokens, self.salt)
        first = output.outputs[0]
        usage = {"prompt_tokens": len(tokens), "cached_tokens": output.num_cached_tokens}
        done = {"id": call.id, "text": first.text, "token_ids": list(first.token_ids)}
        return {"kv_transfer_params": kv, "prefill": done | usage}

    async def lines(self, call: Call) -> AsyncIterator[bytes]:
        """The early answer: the open handover's params, then the whole answer (or its error)."""
        yield (json.dumps({"kv_transfer_params": self.early}) + "\n").encode()
        try:
            yield (json.dumps(await self.answer(call)) + "\n").encode()
        except CallError as err:
            yield (json.dumps(err.body) + "\n").encode()


def add_pull_route(app: FastAPI, state: ServerState, puller: Puller | None) -> None:
    """The decode worker's route: pull a handover's blocks into its host tier."""

    @app.post("/kvcache/pull")
    async def pull(raw: dict[str, object]) -> JSONResponse:
        if puller is None:
            raise CallError(404, "this worker is not a decode worker", "invalid_request_error")
        if state.draining:
            raise CallError(503, "the server is shutting down", "service_unavailable")
        try:
            loop = asyncio.get_running_loop()  # the puller's own threads: a pull waits long
            return JSONResponse(await loop.run_in_executor(puller.executor, puller.pull, raw))
        except ValueError as err:
            raise CallError(400, str(err), "invalid_request_error") from err


def add_info_routes(app: FastAPI, parts: RoleParts) -> None:
    """Both roles' routes: the engine's recorded metrics and what the handovers did."""

    @app.get("/kvcache/metrics")
    async def metrics() -> JSONResponse:
        llm = parts.llm
        if llm is None or not llm.config.record_metrics:
            raise CallError(404, "this worker records no metrics", "invalid_request_error")
        return JSONResponse(await asyncio.to_thread(worker_metrics, llm))

    @app.get("/kvcache/disagg", response_model=None)
    async def disagg() -> JSONBody:
        handover = redact_url(parts.options.handover)  # never the Redis password
        out: JSONBody = {"role": parts.options.role, "handover": handover}
        if parts.publisher is not None:
            out["published"] = parts.publisher.stats()
        if parts.puller is not None:
            out["pulled"] = parts.puller.stats()
        return out


def worker_metrics(llm: ServingEngine) -> JSONBody:
    """``llm.metrics()`` with ``t0_unix_s``: the wall-clock time its ``t_start_s`` count from."""
    out = llm.metrics()
    out["t0_unix_s"] = time.time() - (time.perf_counter() - llm.metrics_t0)
    return out
