"""The FastAPI app: OpenAI's routes over one engine loop (their bodies in completion_route.py and
chat_route.py; vLLM's /tokenize, /detokenize, /version and /ping in utility_routes.py; a field
a request carries that the server does not know logged once and ignored), its error shape for
every failure (400 naming the field, 401, 404, 408 for a body too slow, 429 with Retry-After,
500, 503 while draining), /health, /metrics and /kvcache/info (what the router needs to hash
prompts as the engine does). With an API key every route but /health needs it; every error text
passes through the server's Masker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from runner.engine.api.interface import EngineInterface
from runner.sampling.params import SamplingParams
from runner.serve.auth import ALL_BUT_HEALTH, require_api_key
from runner.serve.body_deadline import BodyDeadline
from runner.serve.body_limit import BodyLimit
from runner.serve.calls import CallError
from runner.serve.chat_route import chat
from runner.serve.completion_route import complete
from runner.serve.engine_loop import EngineLoop
from runner.serve.grammar_work import GrammarWork
from runner.serve.json_types import JSONBody
from runner.serve.metrics import ServeMetrics
from runner.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    field_named,
    samples_per_prompt,
)
from runner.serve.responses import LogprobFormat, error_body
from runner.serve.state import ServerState, ServeSettings
from runner.serve.templates import ChatRenderer
from runner.serve.utility_routes import add_utility_routes

__all__ = ["ServeSettings", "ServerState", "build_app"]


def build_app(llm: EngineInterface, settings: ServeSettings) -> FastAPI:
    """The app over `llm`, whose engine loop runs from the app's startup to its shutdown."""
    metrics = ServeMetrics(settings.model_name, llm.max_model_len)
    renderer = ChatRenderer(llm.apply_chat_template, settings.template_bounds)
    engine = EngineLoop(llm, metrics, renderer, settings.masker())
    grammars = GrammarWork(llm.check_structured_outputs, settings.grammar_bounds)
    state = ServerState(llm, settings, engine, metrics, LogprobFormat(llm.tokenizer), grammars)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        yield
        state.engine.stop()
        state.tokenizing.close()
        state.grammars.close()

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

    @app.get("/v1/models", response_model=None)
    async def models() -> JSONBody:
        card: JSONBody = {"id": settings.model_name, "object": "model", "owned_by": "kvcache"}
        card |= {"created": 0, "max_model_len": llm.max_model_len, "kvcache": _info(state)}
        aliases = [card | {"id": name} for name in settings.model_aliases]
        return {"object": "list", "data": [card, *aliases]}

    @app.get("/kvcache/info", response_model=None)
    async def info() -> JSONBody:
        return _info(state) | {"queued": state.engine.queued(), "live": state.engine.live()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.warn_unknown(body)
        params = await admit(state, body, len(body.prompts()))
        return await complete(state, body, request, params)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.warn_unknown(body)
        params = await admit(state, body, 1)
        return await chat(state, body, request, params)

    add_utility_routes(app, state)
    return app


def _info(state: ServerState) -> JSONBody:
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
        "kv_events": llm.kv_event_endpoints(),
    }


async def admit(state: ServerState, body: SamplingFields, prompts: int) -> SamplingParams:
    """The call's SamplingParams, if the server takes it now: 503 while draining, 404 for
    another model, 400 for a bad value or for more samples than the queue could ever hold,
    429 past the queue's bound. The fields are checked on a worker thread: a request at the
    fields' bounds (thousands of logit_bias keys, hundreds of stop strings) does not hold up
    the event loop, and with it every stream and /health. Its structure is compiled on the
    structure compiler's threads, within their bounds (grammar_work.py), not the engine's."""
    _check_admission(state, body, prompts)
    params = await asyncio.to_thread(_sampling_params, body)
    _check_queue(state, body, prompts)
    forced = isinstance(body, ChatCompletionRequest) and body.tool_mode() in ("required", "named")
    param = "tools" if forced else body.structure_field()
    await state.grammars.check(params.structured_outputs, param)
    return params


def _check_admission(state: ServerState, body: SamplingFields, prompts: int) -> None:
    if state.draining:
        raise CallError(503, "the server is shutting down", "service_unavailable")
    names = (state.settings.model_name, *state.settings.model_aliases)
    if body.model is not None and body.model not in names:
        message = f"model {body.model!r} is not served here (this is {state.settings.model_name!r})"
        raise CallError(404, message, "invalid_request_error", "model")
    if (
        isinstance(body, ChatCompletionRequest)
        and body.sends_template()
        and not state.settings.trust_request_chat_template
    ):
        param = "chat_template" if body.chat_template else "chat_template_kwargs.chat_template"
        message = (
            f"{param}: this server renders only its own chat template (start it with "
            "--trust-request-chat-template to take a client's)"
        )
        raise CallError(400, message, "invalid_request_error", param)
    samples = prompts * samples_per_prompt(body)
    limit = state.settings.max_queued_requests
    if samples > limit:  # it could never be queued, however long the client waited
        message = (
            f"this request holds {samples} samples (prompts x n); the server queues at most "
            f"{limit} (--max-queued-requests)"
        )
        raise CallError(400, message, "invalid_request_error", "n" if prompts == 1 else "prompt")


def _sampling_params(body: SamplingFields) -> SamplingParams:
    try:
        return body.sampling_params()
    except ValueError as err:
        raise CallError(400, str(err), "invalid_request_error", field_named(str(err))) from err


def _check_queue(state: ServerState, body: SamplingFields, prompts: int) -> None:
    samples = prompts * samples_per_prompt(body)
    if state.engine.queued() + samples > state.settings.max_queued_requests:
        state.metrics.rejected.labels(status="429").inc()
        raise CallError(429, "too many requests queued; retry later", "rate_limit_exceeded")


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    settings = state.settings
    masker = settings.masker()

    require_api_key(app, settings.api_key, ALL_BUT_HEALTH)
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

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
        elif loc:
            param = ".".join(loc)
            message = f"{param}: {first.get('msg')}"
        else:  # a check of the whole body: its message starts with the field it is about
            message = str(first.get("msg")).removeprefix("Value error, ")
            param = field_named(message)
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        body = error_body(masker.mask(str(err.detail)), "invalid_request_error")
        return JSONResponse(body, err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception) -> Response:
        body = error_body(masker.mask(f"{type(err).__name__}: {err}"), "server_error")
        return JSONResponse(body, 500)
