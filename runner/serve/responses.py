"""OpenAI's response bodies: completions and chat completions, whole or as stream chunks, their
usage (with the prefix cache's hits as `prompt_tokens_details.cached_tokens`), log-probabilities
in each endpoint's own shape, and the error object."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict

from runner.engine.requests.outputs import RequestOutput
from runner.sampling.logprobs import TokenLogprobs
from runner.serve.json_types import JSONBody
from runner.serve.tool_answers import ToolPlan, finish_reason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ErrorObject(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    error: ErrorObject


class CompletionLogprobs(TypedDict):
    """The completions endpoint's log-probabilities: parallel lists, a token each."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> ErrorBody:
    """OpenAI's error object: {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(payload: Mapping[str, object] | str) -> str:
    """One server-sent event: `data: <json>` (or the final `[DONE]`) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, reused_segment_tokens: int = 0
) -> JSONBody:
    details: dict[str, int] = {"cached_tokens": cached_tokens}
    if reused_segment_tokens:  # ours, beside OpenAI's: tokens of later segments reused
        details["reused_segment_tokens"] = reused_segment_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


def usage_of(outputs: Sequence[RequestOutput]) -> JSONBody:
    """Usage of one call's requests: every sample's tokens; a prompt (and its cached tokens,
    sample 0's) counted once per request."""
    return usage(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(s.token_ids) for o in outputs for s in o.outputs),
        sum(o.num_cached_tokens for o in outputs),
        sum(o.num_reused_segment_tokens for o in outputs),
    )


class LogprobFormat:
    """Token strings for log-probabilities, decoded one token at a time."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer

    def prompt_text(self, output: RequestOutput) -> str:
        """The text of `output`'s prompt (decoded when it came as token ids)."""
        if output.prompt is not None:
            return output.prompt
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(output.prompt_token_ids)))

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def completion(
        self, token_ids: list[int], logprobs: Sequence[TokenLogprobs | None], offset: int
    ) -> CompletionLogprobs:
        """The completions shape: parallel lists, `text_offset` from `offset` characters (an
        echoed prompt's first token has no log-probability: None, as vLLM's)."""
        tokens = [self.token(t) for t in token_ids]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [
                None if lp is None else {self.token(t): v for t, v in lp.top} for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def prompt(
        self, token_ids: list[int], logprobs: Sequence[TokenLogprobs | None] | None
    ) -> list[JSONBody | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id:
        {logprob, rank, decoded_token}} for the token and the likeliest of its position."""
        if logprobs is None:
            return None
        out: list[JSONBody | None] = []
        for token_id, entry in zip(token_ids, logprobs, strict=True):
            if entry is None:
                out.append(None)
                continue
            position: JSONBody = {str(token_id): self._vllm(entry.logprob, entry.rank, token_id)}
            for rank, (top_id, value) in enumerate(entry.top, start=1):
                position.setdefault(str(top_id), self._vllm(value, rank, top_id))
            out.append(position)
        return out

    def _vllm(self, logprob: float, rank: int | None, token_id: int) -> JSONBody:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.token(token_id)}

    def chat(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> JSONBody:
        """The chat shape: one entry per token, with its bytes and its top alternatives."""
        return {
            "content": [
                {
                    **self._entry(t, lp.logprob),
                    "top_logprobs": [self._entry(a, v) for a, v in lp.top],
                }
                for t, lp in zip(token_ids, logprobs, strict=True)
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> JSONBody:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion_response(
    call_id: str,
    model: str,
    created: int,
    outputs: list[RequestOutput],
    fmt: LogprobFormat,
    echo: bool = False,
) -> JSONBody:
    """The whole answer of POST /v1/completions: choice i * n + j is prompt i's sample j; with
    `echo` each text (and its log-probabilities) begins with its prompt's."""
    choices: list[JSONBody] = []
    for output in outputs:
        prompt_ids = list(output.prompt_token_ids)
        prompt_text = fmt.prompt_text(output) if echo else ""
        for sample in output.outputs:
            logprobs = None
            if sample.token_logprobs is not None:
                ids = list(sample.token_ids)
                entries: list[TokenLogprobs | None] = list(sample.token_logprobs)
                if echo and output.prompt_token_logprobs is not None:
                    ids = prompt_ids + ids
                    entries = [*output.prompt_token_logprobs, *entries]
                logprobs = fmt.completion(ids, entries, 0)
            choices.append(
                {
                    "index": len(choices),
                    "text": prompt_text + sample.text,
                    "logprobs": logprobs,
                    "finish_reason": sample.finish_reason,
                    "prompt_logprobs": fmt.prompt(prompt_ids, output.prompt_token_logprobs),
                }
            )
    return {
        "id": call_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_of(outputs),
    }


def chat_response(
    call_id: str,
    model: str,
    created: int,
    output: RequestOutput,
    fmt: LogprobFormat,
    tools: ToolPlan | None = None,
    echo: str = "",
) -> JSONBody:
    """The whole answer of POST /v1/chat/completions: one choice per sample, its tool calls
    read out of its text when the request offered `tools` (content None when the answer is
    only calls); `echo`, the text the answer goes on from, begins each content."""
    choices: list[JSONBody] = []
    for sample in output.outputs:
        logprobs = None
        if sample.token_logprobs is not None:
            logprobs = fmt.chat(sample.token_ids, sample.token_logprobs)
        content: str | None = sample.text
        calls: list[JSONBody] | None = None
        reason = sample.finish_reason
        if tools is not None:
            parsed = tools.answer(sample.text)
            content = parsed.content
            calls = [call.as_openai() for call in parsed.calls]
            reason = finish_reason(reason, len(parsed.calls))
        if echo:
            content = echo + (content or "")
        message: JSONBody = {"role": "assistant", "content": content}
        if calls is not None:
            message["tool_calls"] = calls
        choices.append(
            {
                "index": sample.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        )
    answer = {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_of([output]),
    }
    if output.prompt_token_logprobs is not None:
        answer["prompt_logprobs"] = fmt.prompt(
            list(output.prompt_token_ids), output.prompt_token_logprobs
        )
    return answer


def stream_chunk(
    kind: str,
    call_id: str,
    model: str,
    created: int,
    choices: list[JSONBody],
    usage: JSONBody | None = None,
) -> JSONBody:
    """One streamed chunk in OpenAI's shape; the usage only where it is sent (the last)."""
    chunk: JSONBody = {
        "id": call_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


completion_chunk = functools.partial(stream_chunk, "text_completion")
chat_chunk = functools.partial(stream_chunk, "chat.completion.chunk")
