"""The FastAPI app: OpenAI's routes over one engine loop, its error shape for every failure
(400 naming the field, 401, 404, 408 for a body too slow, 429 with Retry-After, 500, 503 while
draining), /health, /metrics and /kvcache/info (what the router needs to hash prompts as the
engine does). With an API key every route but /health needs it; every error text passes
through the server's Masker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from runner.serve.auth import ALL_BUT_HEALTH, require_api_key
from runner.serve.body_deadline import BodyDeadline
from runner.serve.calls import Call, CallError
from runner.serve.engine_loop import EngineLoop
from runner.serve.events import Delta, Submission
from runner.serve.masking import Masker
from runner.serve.metrics import ServeMetrics
from runner.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    field_named,
    samples_per_prompt,
)
from runner.serve.responses import (
    LogprobFormat,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
)
from runner.serve.templates import ChatRenderer, RenderBounds


@dataclass
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_queued_requests: int = 1024  # samples (prompts x n) waiting to start
    retry_after_s: int = 1
    trust_request_chat_template: bool = False  # vLLM's flag: a client's own chat_template
    template_bounds: RenderBounds = RenderBounds()
    body_timeout_s: float = 30.0  # from the request's head to the last byte of its body
    secret_urls: tuple[str, ...] = ()  # shown masked wherever they appear (tiers, handover)

    def masker(self) -> Masker:
        keys = (self.api_key,) if self.api_key else ()
        return Masker(self.secret_urls, keys)


@dataclass
class ServerState:
    """What the routes share: the engine loop, its metrics, and whether the server drains."""

    llm: Any
    settings: ServeSettings
    engine: EngineLoop
    metrics: ServeMetrics
    fmt: LogprobFormat
    draining: bool = False


def build_app(llm: Any, settings: ServeSettings) -> FastAPI:
    """The app over `llm`, whose engine loop runs from the app's startup to its shutdown."""
    metrics = ServeMetrics(settings.model_name, llm.max_model_len)
    renderer = ChatRenderer(llm.apply_chat_template, settings.template_bounds)
    engine = EngineLoop(llm, metrics, renderer, settings.masker())
    state = ServerState(llm, settings, engine, metrics, LogprobFormat(llm.tokenizer))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        yield
        state.engine.stop()

    app = FastAPI(title="kvcache", lifespan=lifespan)
    app.state.serve = state
    _add_error_handlers(app, state)

    @app.get("/health")
    async def health() -> Response:
        ok = state.engine.alive and not state.draining
        return JSONResponse({"status": "ok" if ok else "draining"}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {"id": settings.model_name, "object": "model", "owned_by": "kvcache"}
        card |= {"created": 0, "max_model_len": llm.max_model_len, "kvcache": _info(state)}
        return {"object": "list", "data": [card]}

    @app.get("/kvcache/info")
    async def info() -> dict[str, Any]:
        return _info(state) | {"queued": state.engine.queued(), "live": state.engine.live()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = await admit(state, body, len(body.prompts()))
        subs = [
            Submission("", i, params, prompt=p, cache_salt=body.cache_salt)
            for i, p in enumerate(body.prompts())
        ]
        call = await _start(state, request, subs, "prompt")
        model, n = settings.model_name, body.n
        if not body.stream:
            outputs = await call.outputs()
            return JSONResponse(
                completion_response(call.id, model, call.created, outputs, state.fmt)
            )
        offsets: dict[int, int] = {}

        def chunk_of(delta: Delta) -> dict[str, Any]:
            choice = delta.index * n + delta.sample_index
            logprobs = None
            if delta.logprobs is not None:
                at = offsets.get(choice, 0)
                logprobs = state.fmt.completion(delta.token_ids, delta.logprobs, at)
                offsets[choice] = at + sum(len(t) for t in logprobs["tokens"])
            entry = {"index": choice, "text": delta.text, "logprobs": logprobs}
            entry["finish_reason"] = delta.finish_reason
            return completion_chunk(call.id, model, call.created, [entry])

        def usage_chunk(usage: dict[str, Any]) -> dict[str, Any]:
            return completion_chunk(call.id, model, call.created, [], usage)

        body_iter = call.stream(chunk_of, [], usage_chunk if body.include_usage else None)
        return StreamingResponse(body_iter, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        params = await admit(state, body, 1)
        sub = Submission(
            "",
            0,
            params,
            messages=body.template_messages(),
            template_kwargs=body.chat_template_kwargs,
            cache_salt=body.cache_salt,
        )
        call = await _start(state, request, [sub], "messages")
        model = settings.model_name
        if not body.stream:
            (output,) = await call.outputs()
            return JSONResponse(chat_response(call.id, model, call.created, output, state.fmt))

        def chunk_of(delta: Delta) -> dict[str, Any]:
            logprobs = None
            if delta.logprobs is not None:
                logprobs = state.fmt.chat(delta.token_ids, delta.logprobs)
            entry = {"index": delta.sample_index, "delta": {"content": delta.text}}
            entry |= {"logprobs": logprobs, "finish_reason": delta.finish_reason}
            return chat_chunk(call.id, model, call.created, [entry])

        role = [
            {
                "index": j,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for j in range(body.n)
        ]
        first = [chat_chunk(call.id, model, call.created, role)]

        def usage_chunk(usage: dict[str, Any]) -> dict[str, Any]:
            return chat_chunk(call.id, model, call.created, [], usage)

        body_iter = call.stream(chunk_of, first, usage_chunk if body.include_usage else None)
        return StreamingResponse(body_iter, media_type="text/event-stream")

    return app


def _info(state: ServerState) -> dict[str, Any]:
    """How this replica names cache blocks: enough for a router to compute the same hashes."""
    llm = state.llm
    return {
        "model": state.settings.model_name,
        "model_path": state.settings.masker().mask(str(llm.model_path)),
        "fingerprint": llm.fingerprint,
        "block_size": llm.config.block_size,
        "max_model_len": llm.max_model_len,
        "enable_prefix_caching": llm.config.enable_prefix_caching,
        # Where it publishes its KV events (None: it does not), for `kvcache router --kv-events`
        "kv_events": (pub := getattr(llm, "kv_events", None)) and pub.endpoints(),
    }


async def admit(state: ServerState, body: SamplingFields, prompts: int) -> Any:
    """`_admit`, with the fields checked on a worker thread: a request at the fields' bounds
    (thousands of logit_bias keys, hundreds of stop strings) does not hold up the event
    loop, and with it every stream and /health."""
    _check_admission(state, body, prompts)
    params = await asyncio.to_thread(_sampling_params, body)
    _check_queue(state, body, prompts)
    return params


def _admit(state: ServerState, body: SamplingFields, prompts: int) -> Any:
    """The call's SamplingParams, if the server takes it now: 503 while draining, 404 for
    another model, 400 for a bad value or for more samples than the queue could ever hold,
    429 past the queue's bound (checked on the calling thread; `admit` is the async one)."""
    _check_admission(state, body, prompts)
    params = _sampling_params(body)
    _check_queue(state, body, prompts)
    return params


def _check_admission(state: ServerState, body: SamplingFields, prompts: int) -> None:
    if state.draining:
        raise CallError(503, "the server is shutting down", "service_unavailable")
    if body.model is not None and body.model != state.settings.model_name:
        message = f"model {body.model!r} is not served here (this is {state.settings.model_name!r})"
        raise CallError(404, message, "invalid_request_error", "model")
    template_kwargs = getattr(body, "chat_template_kwargs", None) or {}
    if "chat_template" in template_kwargs and not state.settings.trust_request_chat_template:
        message = (
            "chat_template_kwargs.chat_template: this server renders only its own chat "
            "template (start it with --trust-request-chat-template to take a client's)"
        )
        param = "chat_template_kwargs.chat_template"
        raise CallError(400, message, "invalid_request_error", param)
    samples = prompts * samples_per_prompt(body)
    limit = state.settings.max_queued_requests
    if samples > limit:  # it could never be queued, however long the client waited
        message = (
            f"this request holds {samples} samples (prompts x n); the server queues at most "
            f"{limit} (--max-queued-requests)"
        )
        raise CallError(400, message, "invalid_request_error", "n" if prompts == 1 else "prompt")


def _sampling_params(body: SamplingFields) -> Any:
    try:
        return body.sampling_params()
    except ValueError as err:
        raise CallError(400, str(err), "invalid_request_error", field_named(str(err))) from err


def _check_queue(state: ServerState, body: SamplingFields, prompts: int) -> None:
    samples = prompts * samples_per_prompt(body)
    if state.engine.queued() + samples > state.settings.max_queued_requests:
        state.metrics.rejected.labels(status="429").inc()
        raise CallError(429, "too many requests queued; retry later", "rate_limit_exceeded")


async def _start(state: ServerState, request: Request, subs: list[Submission], param: str) -> Call:
    call = Call(state.engine, request, subs, param)
    for sub in subs:
        sub.request_id = f"{call.id}-{sub.index}"
    await call.start()
    return call


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    settings = state.settings
    masker = settings.masker()

    require_api_key(app, settings.api_key, ALL_BUT_HEALTH)
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)

    @app.exception_handler(CallError)
    async def call_error(request: Request, err: CallError) -> Response:
        headers = {"Retry-After": str(settings.retry_after_s)} if err.status == 429 else None
        err.body["error"]["message"] = masker.mask(err.body["error"]["message"])
        return JSONResponse(err.body, err.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        first = err.errors()[0]
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {first.get('msg')}", None
        else:
            param = ".".join(loc) or None
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        body = error_body(masker.mask(str(err.detail)), "invalid_request_error")
        return JSONResponse(body, err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception) -> Response:
        body = error_body(masker.mask(f"{type(err).__name__}: {err}"), "server_error")
        return JSONResponse(body, 500)
