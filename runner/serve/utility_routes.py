"""vLLM's server routes beside OpenAI's, with vLLM's request and response shapes: POST
/tokenize (a prompt, or messages through the chat template) and /detokenize, GET /version,
and GET or POST /ping (a load balancer's liveness probe: 200 while the server takes
requests, 503 while it drains). The tokenizer runs on threads of its own (tokenizing.py),
never on the event loop."""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import Field, ValidationError

from runner.sampling.text_checks import check_text
from runner.serve.calls import CallError
from runner.serve.messages import ChatMessage, JsonObject, Lenient, template_messages
from runner.serve.state import ServerState
from runner.serve.tokenizing import json_response

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenizeRequest(Lenient):
    """vLLM's two tokenize bodies in one: `prompt` (text) or `messages` (a conversation,
    through the chat template as a chat request renders it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for chat
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[JsonObject] | None = None


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


def add_utility_routes(app: FastAPI, state: ServerState) -> None:
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        ok = state.engine.alive and not state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": metadata.version("kvcache")}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        state.warn_unknown(body)
        tokenizer = _tokenizer(state, body.model)
        text, special = await _text_of(state, body)
        param = "prompt" if body.prompt is not None else "messages"
        max_model_len = state.llm.max_model_len

        def work() -> Response:
            _check_text(param, text)
            ids = list(tokenizer(text, add_special_tokens=special).input_ids)
            answer: dict[str, Any] = {
                "count": len(ids),
                "max_model_len": max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
            if body.return_token_strs:
                answer["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
            return json_response(answer)

        return await state.tokenizing.run(work)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        raw = await request.body()
        # Millions of ids take the JSON parser as long as the decoding: parsed off the loop too.
        body = await state.tokenizing.run(lambda: _detokenize_body(raw))
        state.warn_unknown(body)
        tokenizer = _tokenizer(state, body.model)

        def work() -> Response:
            vocab = len(tokenizer)
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                message = f"tokens: {bad} is outside the vocabulary (0 to {vocab - 1})"
                raise CallError(400, message, "invalid_request_error", "tokens")
            return json_response({"prompt": str(tokenizer.decode(body.tokens))})

        return await state.tokenizing.run(work)


def _detokenize_body(raw: bytes) -> DetokenizeRequest:
    """The body, or the 400 FastAPI gives a body that does not validate."""
    try:
        return DetokenizeRequest.model_validate_json(raw)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None


def _tokenizer(state: ServerState, model: str | None) -> PreTrainedTokenizerBase:
    """The model's tokenizer, after the checks every route makes (the model's name)."""
    name = state.settings.model_name
    if model is not None and model != name:
        message = f"model {model!r} is not served here (this is {name!r})"
        raise CallError(404, message, "invalid_request_error", "model")
    tokenizer = state.llm.tokenizer
    if tokenizer is None:
        raise CallError(400, "this model has no tokenizer", "invalid_request_error")
    return tokenizer


def _check_text(param: str, text: str) -> None:
    """A 400 naming `param` for text no tokenizer takes (a lone surrogate), not the
    tokenizer's TypeError as a 500."""
    try:
        check_text(param, text)
    except ValueError as err:
        raise CallError(400, str(err), "invalid_request_error", param) from None


async def _text_of(state: ServerState, body: TokenizeRequest) -> tuple[str, bool]:
    """The text to tokenize and whether special tokens are added to it."""
    if (body.prompt is None) == (body.messages is None):
        message = "give either prompt or messages"
        raise CallError(400, message, "invalid_request_error", "prompt")
    if body.prompt is not None:
        return body.prompt, True if body.add_special_tokens is None else body.add_special_tokens
    given_template = body.chat_template is not None or "chat_template" in (
        body.chat_template_kwargs or {}
    )
    if given_template and not state.settings.trust_request_chat_template:
        message = (
            "chat_template: this server renders only its own chat template (start it with "
            "--trust-request-chat-template to take a client's)"
        )
        raise CallError(400, message, "invalid_request_error", "chat_template")
    options: dict[str, Any] = {"add_generation_prompt": body.add_generation_prompt}
    if body.continue_final_message:
        options |= {"continue_final_message": True, "add_generation_prompt": False}
    template = body.chat_template or state.settings.chat_template
    if template is not None:
        options["chat_template"] = template
    options.update(body.chat_template_kwargs or {})
    try:
        messages = template_messages(body.messages or [])
        text = await state.engine.renderer.render_async(messages, options, body.tools)
    except ValueError as err:
        raise CallError(400, str(err), "invalid_request_error", "messages") from err
    return text, bool(body.add_special_tokens)
