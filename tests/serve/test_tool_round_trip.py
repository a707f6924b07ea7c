"""The tool round trip of vLLM's openai_chat_completion_client_with_tools.py, closed with the
official openai client: the assistant's calls sent back with their content left out, null, ""
or with `tool_calls: []`, each accepted and rendered (content "", as vLLM renders it) through a
template that adds the content to a string (SmolLM2's, which a null content broke), streamed
and not, under each tool-call parser. And a "required" answer that runs out of room: the calls
it completed come back, its finish_reason "length", never text alone."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from runner.serve.tool_answers import ToolPlan
from runner.serve.tool_calls import calls_before_cut
from tests.serve.conftest import LiveServer, ServeFactory
from tests.serve.test_tool_calling import QUESTION, TOOLS, client, run_tool, streamed_calls

# SmolLM2-Instruct's own template (`'...' + message['content'] + '...'` fails on a null
# content), with the tools' names shown (else the server's Hermes prompt outgrows the tiny
# model's context).
SMOLLM_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    "{% endif %}{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SHAPES = ("missing", "null", "empty", "no_calls")


def assistant_turn(shape: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant's message as clients send it back: vLLM's example leaves content out."""
    if shape == "no_calls":
        return {"role": "assistant", "tool_calls": []}
    message: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
    if shape != "missing":
        message["content"] = None if shape == "null" else ""
    return message


def first_call(api: Any) -> dict[str, Any]:
    """Turn 1, forced to one call (the random model makes none by itself)."""
    answer = api.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    (call,) = answer.choices[0].message.tool_calls
    return call.model_dump(exclude_none=True)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_the_round_trip_closes_in_every_shape(
    serve: ServeFactory, parser: str, stream: bool
) -> None:
    with serve(chat_template=SMOLLM_TEMPLATE, tool_call_parser=parser) as live:
        api = client(live)
        call = first_call(api)
        result = run_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
        for shape in SHAPES:
            history = [*QUESTION, assistant_turn(shape, [call])]
            if shape == "no_calls":
                history.append({"role": "user", "content": "And in Oslo?"})
            else:
                history.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            body: dict[str, Any] = dict(
                model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0
            )
            if stream:
                text, _, reason = streamed_calls(api.chat.completions.create(**body, stream=True))
            else:
                reply = api.chat.completions.create(**body)
                text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
            assert reason in ("stop", "length"), (shape, reason)
            assert text, shape

            # Rendered as vLLM renders it: the assistant's missing content is "".
            tokens = httpx.post(
                f"{live.url}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30
            ).json()["tokens"]
            prompt = live.state.llm.tokenizer.decode(tokens)
            assert "<|im_start|>assistant\n<|im_end|>\n" in prompt, shape


def test_other_roles_still_need_content(server: LiveServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user"}], "max_tokens": 4}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith("messages[0].content: needed")


def test_the_python_chat_takes_an_assistant_turn_without_content(reference_llm: Any) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "tool_calls": []},
        {"role": "user", "content": "b"},
    ]
    for chat_template in (None, SMOLLM_TEMPLATE):
        options = {} if chat_template is None else {"chat_template": chat_template}
        text = reference_llm.apply_chat_template(messages, options)
        assert ("<|assistant|></s>" if chat_template is None else "assistant\n<|im_end|>") in text


@pytest.mark.parametrize("stream", [False, True])
def test_required_cut_short_gives_the_calls_it_completed(serve: ServeFactory, stream: bool) -> None:
    """The tiny model goes on calling until max_tokens (a model may until the context's end):
    the complete calls come back as calls, the finish_reason says the answer was cut."""
    with serve(chat_template=SMOLLM_TEMPLATE) as live:
        api = client(live)
        body: dict[str, Any] = dict(
            model="tiny",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=120,
            temperature=0,
        )
        if stream:
            chunks = api.chat.completions.create(**body, stream=True)
            content, calls, reason = streamed_calls(chunks)
        else:
            answer = api.chat.completions.create(**body)
            message = answer.choices[0].message
            content, reason = message.content, answer.choices[0].finish_reason
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in message.tool_calls or []
            ]
    assert reason == "length"
    assert content is None
    assert len(calls) >= 2
    for call in calls:
        assert call["id"].startswith("call_")
        arguments = json.loads(call["arguments"])
        assert arguments in ({"city": "Paris"}, {"city": "Oslo"}, {"zone": "UTC"}, {"zone": "CET"})


def test_calls_before_cut_reads_whole_items_only() -> None:
    whole = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert calls_before_cut(f'[{whole}, {whole}, {{"name": "get_w', TOOLS) != []
    assert [c.name for c in calls_before_cut(f"[{whole},{whole},{{", TOOLS)] == ["get_time"] * 2
    assert calls_before_cut('[{"name": "get_ti', TOOLS) == []
    assert calls_before_cut('[{"name": "other", "parameters": {}}, ', TOOLS) == []
    assert calls_before_cut("text", TOOLS) == []
    # a named choice's cut answer has no calls to give: it stays text
    plan = ToolPlan("named", TOOLS, {"type": "function", "function": {"name": "get_time"}}, "")
    assert plan.answer('{"zone": "U').content == '{"zone": "U'
