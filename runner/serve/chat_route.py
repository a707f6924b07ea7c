"""POST /v1/chat/completions once admitted: the conversation rendered with the request's
template options and tools, submitted, and answered whole or streamed as OpenAI's chunks, its
tool calls read out of the text by its ToolPlan."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from runner.sampling.params import SamplingParams
from runner.serve.calls import CallError, start_call
from runner.serve.events import Delta, Submission
from runner.serve.json_types import JSONBody
from runner.serve.protocol import ChatCompletionRequest
from runner.serve.responses import chat_chunk, chat_response
from runner.serve.state import ServerState
from runner.serve.tool_answers import ToolPlan, ToolStream, finish_reason


def chat_submission(
    state: ServerState, body: ChatCompletionRequest, params: SamplingParams
) -> Submission:
    """The request's one engine submission: its messages as the template gets them, the
    template's options (the server's --chat-template unless the client sent one) and tools;
    CallError 400 naming a bad message or option."""
    try:
        messages = body.template_messages()
        options = body.template_options()
    except ValueError as err:
        message = str(err)
        param = message.split(":", 1)[0] if ":" in message else "messages"
        raise CallError(400, message, "invalid_request_error", param) from err
    if "chat_template" not in options and state.settings.chat_template is not None:
        options["chat_template"] = state.settings.chat_template
    return Submission(
        "",
        0,
        params,
        messages=messages,
        template_kwargs=options,
        tools=body.tools or None,
        cache_salt=body.cache_salt,
        priority=body.priority,
    )


def tool_plan(
    state: ServerState, body: ChatCompletionRequest, options: Mapping[str, object]
) -> ToolPlan | None:
    """How the answers are read for calls; None when the request offers no tools or
    tool_choice is "none"."""
    mode = body.tool_mode()
    if mode is None:
        return None
    return ToolPlan(mode, body.tools or [], body.tool_choice, state.tool_parser(options))


def echoed(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text, when it is the model's own (the answer
    goes on from it)."""
    last = body.messages[-1]
    return (last.text() or "") if body.echo and last.role == "assistant" else ""


async def chat(
    state: ServerState, body: ChatCompletionRequest, request: Request, params: SamplingParams
) -> Response:
    sub = chat_submission(state, body, params)
    plan = tool_plan(state, body, sub.template_kwargs or {})
    call = await start_call(state.engine, request, [sub], "messages")
    model, fmt, echo = state.settings.model_name, state.fmt, echoed(body)
    if not body.stream:
        (output,) = await call.outputs()
        return JSONResponse(chat_response(call.id, model, call.created, output, fmt, plan, echo))
    streams: dict[int, ToolStream] = {}

    def chunks_of(delta: Delta) -> list[JSONBody]:
        logprobs = None
        if delta.logprobs is not None:
            logprobs = fmt.chat(delta.token_ids, delta.logprobs)
        reason = delta.finish_reason
        if plan is None:
            deltas: list[JSONBody] = [{"content": delta.text}]
        else:
            stream = streams.setdefault(delta.sample_index, plan.stream())
            deltas = stream.feed(delta.text)
            if reason is not None:
                deltas += stream.end()
                reason = finish_reason(reason, stream.calls)
            if not deltas and (logprobs is not None or reason is not None):
                deltas = [{}]  # the logprobs or the finish still go out
        entries: list[JSONBody] = [
            {"index": delta.sample_index, "delta": d, "logprobs": None, "finish_reason": None}
            for d in deltas
        ]
        if entries:
            entries[0]["logprobs"] = logprobs
            entries[-1]["finish_reason"] = reason
        return [chat_chunk(call.id, model, call.created, [entry]) for entry in entries]

    role: list[JSONBody] = [
        {
            "index": j,
            "delta": {"role": "assistant", "content": echo},
            "logprobs": None,
            "finish_reason": None,
        }
        for j in range(body.n)
    ]
    first = [chat_chunk(call.id, model, call.created, role)]

    def usage_chunk(usage: JSONBody) -> JSONBody:
        return chat_chunk(call.id, model, call.created, [], usage)

    usage = usage_chunk if body.include_usage else None
    body_iter = call.stream(chunks_of, first, usage, state.settings.stream_keepalive_s)
    return StreamingResponse(body_iter, media_type="text/event-stream")
