"""Tool calling through `kvcache serve` with the official openai client, whole and streamed: an
agent loop with two tools (turn 1 forced by tool_choice "required" or a named function, so
even the tiny random model's calls parse; the tool's result sent back as a "tool" message with
the assistant's calls and content null; turn 2 with tool_choice "none" answers in text), the
template given the calls' arguments as objects (as vLLM gives them), a template that ignores
tools taught them by a system message, and "auto" answers read as they stream."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from runner.serve.tool_answers import ToolPlan
from tests.serve.conftest import LiveServer, ServeFactory

# A chat template that shows the tools and renders calls and their results (the arguments as
# JSON of the object the template gets).
TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</s>"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% for c in m['tool_calls'] or [] %}{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% if m['tool_call_id'] %}{{ m['tool_call_id'] }}={% endif %}{{ m['content'] or '' }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    """The agent's side: what each tool answers."""
    if name == "get_weather":
        return json.dumps({"city": arguments["city"], "celsius": 21})
    return json.dumps({"zone": arguments["zone"], "time": "12:00"})


def streamed_calls(stream: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """A streamed answer put together as an agent framework does: content, the calls by
    their index (name and id from their first delta, arguments joined), the finish_reason."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or part.id
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.fixture
def tool_server(serve: ServeFactory) -> Any:
    with serve(chat_template=TEMPLATE) as live:
        yield live


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_an_agent_loop_with_two_tools(tool_server: LiveServer, stream: bool, choice: str) -> None:
    api = client(tool_server)
    tool_choice: Any = NAMED if choice == "named" else "required"
    first: dict[str, Any] = dict(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice
    )
    first |= {"max_tokens": 60, "temperature": 0, "parallel_tool_calls": False, "store": False}
    if stream:
        content, calls, reason = streamed_calls(api.chat.completions.create(**first, stream=True))
    else:
        answer = api.chat.completions.create(**first)
        message = answer.choices[0].message
        content, reason = message.content, answer.choices[0].finish_reason
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []
        ]
    assert content is None, content
    assert reason == "tool_calls"
    assert len(calls) == 1
    (call,) = calls
    assert call["id"].startswith("call_")
    assert call["name"] in ("get_weather", "get_time")
    if choice == "named":
        assert call["name"] == "get_weather"
    arguments = json.loads(call["arguments"])  # forced: it always parses
    assert arguments in ({"city": "Paris"}, {"city": "Oslo"}, {"zone": "UTC"}, {"zone": "CET"})

    # Turn 2: the calls and their results go back; the model answers in text.
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": run_tool(call["name"], arguments)},
    ]
    second: dict[str, Any] = dict(model="tiny", messages=history, tools=TOOLS, tool_choice="none")
    second |= {"max_tokens": 8, "temperature": 0}
    if stream:
        text, none, reason = streamed_calls(api.chat.completions.create(**second, stream=True))
        assert none == []
    else:
        reply = api.chat.completions.create(**second)
        assert not reply.choices[0].message.tool_calls
        text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text and reason in ("stop", "length")

    # The template got the history as vLLM gives it: the arguments as an object, the result
    # under its call's id.
    tokens = httpx.post(
        f"{tool_server.url}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30
    ).json()["tokens"]
    prompt = tool_server.state.llm.tokenizer.decode(tokens)
    assert f"<|assistant|>{call['name']}{json.dumps(arguments)}</s>" in prompt
    assert f"<|tool|>{call['id']}={run_tool(call['name'], arguments)}</s>" in prompt
    assert prompt.startswith("<|tools|>get_weather;get_time;</s>")


def test_parallel_calls_cut_short_stay_text_and_bad_choices_are_400s(
    tool_server: LiveServer,
) -> None:
    body = {"model": "tiny", "messages": QUESTION, "tools": TOOLS, "max_tokens": 120}
    answer = httpx.post(
        f"{tool_server.url}/v1/chat/completions",
        json={**body, "tool_choice": "required", "temperature": 0},
        timeout=60,
    ).json()
    choice = answer["choices"][0]
    # With parallel calls allowed this model goes on calling until max_tokens: the calls it
    # completed come back, and the finish_reason says it was cut
    # (tests/serve/test_tool_round_trip.py).
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    assert len(choice["message"]["tool_calls"]) >= 2
    missing = {"type": "function", "function": {"name": "get_stock"}}
    resp = httpx.post(
        f"{tool_server.url}/v1/chat/completions", json={**body, "tool_choice": missing}, timeout=30
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "tool_choice"
    assert "get_stock" in resp.json()["error"]["message"]
    bad_tool = {**body, "tools": [{"type": "function", "function": {"parameters": {}}}]}
    resp = httpx.post(f"{tool_server.url}/v1/chat/completions", json=bad_tool, timeout=30)
    assert resp.status_code == 400 and "name" in resp.json()["error"]["message"], resp.text


def test_auto_answers_stream_as_they_read_whole(tool_server: LiveServer) -> None:
    """The random model makes no call: "auto" gives its text, the same streamed or not."""
    api = client(tool_server)
    body: dict[str, Any] = dict(
        model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=24, temperature=0
    )
    whole = api.chat.completions.create(**body)
    assert whole.choices[0].message.tool_calls == []
    content, calls, reason = streamed_calls(api.chat.completions.create(**body, stream=True))
    assert calls == [] and content == whole.choices[0].message.content
    assert reason == whole.choices[0].finish_reason


def test_a_template_that_ignores_tools_is_taught_them(server: LiveServer) -> None:
    """The tests' own template shows no tools: the server adds a system message teaching the
    Hermes format, with each tool's schema."""
    url = f"{server.url}/tokenize"
    plain = httpx.post(url, json={"messages": QUESTION}, timeout=30).json()
    taught = httpx.post(url, json={"messages": QUESTION, "tools": [WEATHER]}, timeout=30).json()
    prompt = server.state.llm.tokenizer.decode(taught["tokens"])
    assert taught["count"] > plain["count"]
    assert prompt.startswith("<|system|>") and "<tool_call>" in prompt
    assert json.dumps(WEATHER) in prompt


@pytest.mark.parametrize(
    ("parser", "pieces", "content"),
    [
        (
            "hermes",
            ["Sure. <to", 'ol_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}'],
            "Sure. ",
        ),
        (
            "mistral",
            ["[TOOL_", 'CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'],
            "",
        ),
        (
            "llama3_json",
            ["  <|python", '_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'],
            "",
        ),
    ],
)
def test_auto_streams_text_then_holds_a_call(parser: str, pieces: list[str], content: str) -> None:
    stream = ToolPlan("auto", TOOLS, "auto", parser).stream()
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    assert "".join(d.get("content", "") for d in deltas) == content
    end = stream.end()
    (calls,) = [d["tool_calls"] for d in end if "tool_calls" in d]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert stream.calls == 1


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json"])
def test_auto_text_that_only_looks_like_a_call_is_text(parser: str) -> None:
    pieces = ["The <tool", "box> and [TOOL", "S] {are} here"]
    stream = ToolPlan("auto", TOOLS, None, parser).stream()
    sent = [d for piece in pieces for d in stream.feed(piece)] + stream.end()
    assert "".join(d["content"] for d in sent) == "".join(pieces)
    assert stream.calls == 0


def test_the_python_chat_takes_tool_messages_and_text_parts(reference_llm: Any) -> None:
    """LLM.chat renders what the server renders: an assistant's calls with content None, a
    tool's answer, and content given as text parts (joined by newlines, as vLLM joins them)."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {"zone": "UTC"}},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    text = reference_llm.apply_chat_template(messages)
    assert text == "<|user|>a\nb</s><|assistant|></s><|tool|>12:00</s><|assistant|>"
