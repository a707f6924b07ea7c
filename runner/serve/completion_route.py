"""POST /v1/completions once admitted: its prompts submitted as one call, answered whole or
streamed as OpenAI's chunks; with `echo` each choice's text (and log-probabilities) begins
with its prompt, as vLLM's server gives it."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.sampling.params import SamplingParams
from runner.serve.calls import start_call
from runner.serve.events import Delta, Submission
from runner.serve.json_types import JSONBody
from runner.serve.protocol import CompletionRequest
from runner.serve.responses import completion_chunk, completion_response
from runner.serve.state import ServerState


async def complete(
    state: ServerState, body: CompletionRequest, request: Request, params: SamplingParams
) -> Response:
    prompts = body.prompts()
    subs = [
        Submission("", i, params, prompt=p, cache_salt=body.cache_salt, priority=body.priority)
        for i, p in enumerate(prompts)
    ]
    call = await start_call(state.engine, request, subs, "prompt")
    model, n, fmt = state.settings.model_name, body.n, state.fmt
    if not body.stream:
        outputs = await call.outputs()
        answer = completion_response(call.id, model, call.created, outputs, fmt, body.echo)
        return JSONResponse(answer)
    offsets: dict[int, int] = {}
    first: list[JSONBody] = []
    if body.echo:  # each choice's prompt first, in a chunk of its own
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else _decoded(state, prompt)
            for j in range(n):
                entry = {"index": i * n + j, "text": text, "logprobs": None, "finish_reason": None}
                first.append(completion_chunk(call.id, model, call.created, [entry]))
                offsets[i * n + j] = len(text)

    def chunks_of(delta: Delta) -> list[JSONBody]:
        choice = delta.index * n + delta.sample_index
        logprobs = None
        if delta.logprobs is not None:
            at = offsets.get(choice, 0)
            logprobs = fmt.completion(delta.token_ids, delta.logprobs, at)
            offsets[choice] = at + sum(len(t) for t in logprobs["tokens"])
        entry = {"index": choice, "text": delta.text, "logprobs": logprobs}
        entry["finish_reason"] = delta.finish_reason
        return [completion_chunk(call.id, model, call.created, [entry])]

    def usage_chunk(usage: JSONBody) -> JSONBody:
        return completion_chunk(call.id, model, call.created, [], usage)

    body_iter = call.stream(chunks_of, first, usage_chunk if body.include_usage else None)
    return StreamingResponse(body_iter, media_type="text/event-stream")


def _decoded(state: ServerState, prompt: list[int] | SegmentedPrompt) -> str:
    """A prompt's text: token ids decoded, segments joined (their text, or their ids decoded)."""
    tokenizer = state.llm.tokenizer
    if isinstance(prompt, SegmentedPrompt):
        text = prompt.text
        if text is not None:
            return text
        return "".join(s if isinstance(s, str) else _decoded(state, s) for s in prompt.segments)
    return "" if tokenizer is None else str(tokenizer.decode(prompt))
