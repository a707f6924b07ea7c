"""`vllm bench serve` against this server, as its OpenAI backends send and read: the request
bodies its openai-completions and openai-chat backends post (with the `Authorization: Bearer
None` header it sends when no key is set), and the stream it parses (each chunk's first choice's
text or delta content, then a usage chunk). vLLM itself is not installed here (docs/BENCHMARKS.md
shows it run for real); these are its wire shapes, so a change that would break it fails here."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import ServeFactory

from kvcache import LLM, SamplingParams

PROMPT = "the cache holds a prefix and the rest is computed"


def bench_stream(url: str, path: str, payload: dict[str, Any]) -> tuple[str, int, int]:
    """Post as vLLM's bench client does and read the stream as it does: the text, the number
    of chunks that carried text, and the usage's completion tokens."""
    headers = {"Content-Type": "application/json", "Authorization": "Bearer None"}
    text, chunks, completion_tokens = "", 0, 0
    with httpx.stream("POST", url + path, json=payload, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            chunk = line.strip().removeprefix("data: ")
            if not chunk or chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                chat = "chat" in path
                piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                if piece:
                    text += piece
                    chunks += 1
            elif usage := data.get("usage"):
                completion_tokens = usage.get("completion_tokens")
    return text, chunks, completion_tokens


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_completions_backend(serve: ServeFactory, reference_llm: LLM, ignore_eos: bool) -> None:
    payload: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 12,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    with serve() as server:
        text, chunks, tokens = bench_stream(server.url, "/v1/completions", payload)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=ignore_eos)
    (expected,) = reference_llm.generate([PROMPT], params)
    assert text == expected.text
    assert tokens == len(expected.token_ids)
    assert 1 <= chunks <= tokens


def test_the_chat_backend(serve: ServeFactory, reference_llm: LLM) -> None:
    payload = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "temperature": 0.0,
        "max_completion_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with serve() as server:
        text, _, tokens = bench_stream(server.url, "/v1/chat/completions", payload)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    (expected,) = reference_llm.chat([[{"role": "user", "content": PROMPT}]], params)
    assert text == expected.text
    assert tokens == 10
