"""A streamed answer whose text is held (an `auto` tool call, read whole at its end) is not
silent: a keep-alive SSE comment goes out while nothing else can, so a router's idle timeout
does not take a replica still generating for a dead one. Before, nothing was sent from
`<tool_call>` to the end."""

from __future__ import annotations

import json
import time

import httpx

from tests.serve.conftest import ServeFactory

TEMPLATE = "{{ messages[0]['content'] }}{% if tools %}T{% endif %}"  # tools in one character
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_a_held_tool_call_keeps_the_stream_alive(serve: ServeFactory) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [TOOL],
        "tool_choice": "auto",
        "stream": True,
        "max_tokens": 450,
        "temperature": 0,
        # The answer opens a call at once, then goes on: all of it held to the end.
        "structured_outputs": {"regex": "<tool_call>[a-z]{400}"},
    }
    with serve(chat_template=TEMPLATE, stream_keepalive_s=0.05) as server:
        lines: list[tuple[float, str]] = []
        with httpx.Client(timeout=120) as client:
            url = f"{server.url}/v1/chat/completions"
            with client.stream("POST", url, json=body) as resp:
                assert resp.status_code == 200
                lines = [(time.monotonic(), line) for line in resp.iter_lines() if line]
    data = [line for _, line in lines if line.startswith("data: {")]
    chunks = [json.loads(line[len("data: ") :]) for line in data]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.startswith("<tool_call>") and len(text) == len("<tool_call>") + 400
    # Between the role chunk and the held text (sent whole at the end, then [DONE]): only
    # keep-alive comments, one each 0.05 s of the held generation at most.
    between = [line for _, line in lines[1:-2]]
    assert between and set(between) == {": keep-alive"}, lines[:3]
