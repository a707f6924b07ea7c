"""Tool calls read out of each family's format, and the schemas that force them."""

from __future__ import annotations

import json

import pytest

from runner.serve.tool_calls import (
    TOOL_PARSERS,
    forced_calls,
    forced_schema,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parser_for_template,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_hermes_calls_and_the_text_before_them() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c.id.startswith("call_") for c in parsed.calls)


@pytest.mark.parametrize(
    "text",
    [
        "no tools here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    ],
)
def test_text_that_is_no_well_formed_call_stays_text(text: str) -> None:
    for parse in TOOL_PARSERS.values():
        parsed = parse(text)
        assert parsed.calls == [] and parsed.content == text


def test_llama3_json_with_python_tag_and_several_calls() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    parsed = parse_llama3_json(text)
    assert parsed.content is None
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Oslo"}


def test_mistral_tool_calls() -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    parsed = parse_mistral(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Rome"})
    ]


def test_the_parser_is_read_off_the_template() -> None:
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_for_template("<tool_call>") == "hermes"
    assert parser_for_template(None) == "hermes"


def test_forced_schemas_and_their_calls() -> None:
    tools = [WEATHER, TIME]
    assert forced_schema(tools, "auto") is None and forced_schema(tools, "none") is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_schema(tools, named) == WEATHER["function"]["parameters"]
    (call,) = forced_calls('{"city": "Lima"}', tools, named)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lima"}
    required = forced_schema(tools, "required")
    assert required is not None and required["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
    calls = forced_calls('[{"name": "get_time", "parameters": {}}]', tools, "required")
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    with pytest.raises(ValueError, match="raise max_tokens"):
        forced_calls('[{"name": "get_t', tools, "required")


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER], "sometimes", "must be none, auto, required"),
        ([], "required", "required needs tools"),
        ([{"type": "function", "function": {"name": ""}}], "auto", r"tools\[0\].function.name"),
        ([WEATHER, WEATHER], "auto", "unique"),
    ],
)
def test_bad_tools_and_choices_are_named(tools: list, choice: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        forced_schema(tools, choice)  # type: ignore[arg-type]
