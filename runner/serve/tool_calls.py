"""Tool calling, as OpenAI's API and vLLM's server shape it: the tools a chat request offers, the
constraint ``tool_choice`` puts on the answer, and the calls read back out of the model's text.

``tool_choice``:
* ``"none"``: the tools are shown to the template but the answer is plain text;
* ``"auto"`` (the default with tools): the model decides; its text is parsed by the model
  family's tool-call format (``--tool-call-parser``, else inferred from the chat template):
  Hermes' ``<tool_call>{json}</tool_call>`` (Qwen, SmolLM, Hermes), Llama 3's bare JSON object
  (``{"name": ..., "parameters": {...}}``, after an optional ``<|python_tag|>``) and Mistral's
  ``[TOOL_CALLS][{...}]``;
* ``"required"`` and a named function: the answer is held by the structured-output machinery to
  a JSON schema (an array of calls, or the named function's arguments), so the arguments always
  parse, whatever the model.

A call's ``arguments`` are JSON text, as OpenAI returns them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One function call the answer makes."""

    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def as_openai(self) -> JsonObject:
        """The message's ``tool_calls`` entry."""
        return {
            "id": self.id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer split into its text and its calls (no calls: the text is the whole answer)."""

    content: str | None
    calls: list[ToolCall]


def tool_names(tools: list[JsonObject]) -> list[str]:
    """The offered functions' names; ValueError naming a malformed tool."""
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools[{i}]: must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name: must be a non-empty string")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    return names


def chosen_function(tool_choice: str | JsonObject | None, names: list[str]) -> str | None:
    """The function a named ``tool_choice`` forces (None for none/auto/required); ValueError
    for a choice that is neither a mode nor an offered function."""
    if tool_choice is None or isinstance(tool_choice, str):
        if tool_choice not in (None, "none", "auto", "required"):
            raise ValueError(
                f"tool_choice: must be none, auto, required or a function, got {tool_choice!r}"
            )
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice: required needs tools")
        return None
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice: must be {'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise ValueError(f"tool_choice: function {name!r} is not among the tools")
    return name


def _parameters(tools: list[JsonObject], name: str) -> JsonObject:
    for tool in tools:
        if tool["function"]["name"] == name:
            params = tool["function"].get("parameters") or {"type": "object"}
            return dict(params)
    raise KeyError(name)


def forced_schema(
    tools: list[JsonObject], tool_choice: str | JsonObject | None, parallel: bool = True
) -> JsonObject | None:
    """The JSON schema the answer is held to: the named function's arguments object, or for
    ``required`` a non-empty array of ``{"name", "parameters"}`` calls of offered functions
    (one call only without ``parallel``: OpenAI's parallel_tool_calls=false); None when the
    model is free (none, auto).

    In the array each function's parameters schema is kept whole under the array's `$defs`
    (`tool_0`, `tool_1`, ...) and each of its `#` references made to point there: a schema's
    `$defs` and `$ref`s (what pydantic emits), a recursive `{"$ref": "#"}` included, mean
    what they meant at their own root, not the array's."""
    names = tool_names(tools)
    named = chosen_function(tool_choice, names)
    if named is not None:
        return _parameters(tools, named)
    if tool_choice != "required":
        return None
    defs: JsonObject = {}
    calls = []
    for i, name in enumerate(names):
        key = f"tool_{i}"
        defs[key] = _rooted_at(_parameters(tools, name), f"#/$defs/{key}")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "parameters"],
            }
        )
    schema: JsonObject = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    return schema


def _rooted_at(schema: JsonObject, root: str) -> JsonObject:
    """A copy of `schema` with every local reference (`"$ref": "#..."`, a JSON pointer from
    the schema's root) made to point into `root`, where the schema will be placed. Walks
    without recursion: a schema nested as deep as the JSON parser took costs no stack."""
    copy: JsonObject = dict(schema)
    todo: list[JsonObject | list[Any]] = [copy]
    while todo:
        node = todo.pop()
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, value in items:
            if key == "$ref" and isinstance(node, dict) and isinstance(value, str):
                if value.startswith("#"):
                    node[key] = root + value[1:]
            elif isinstance(value, dict | list):
                child = dict(value) if isinstance(value, dict) else list(value)
                node[key] = child  # type: ignore[index]
                todo.append(child)
    return copy


def forced_calls(
    text: str, tools: list[JsonObject], tool_choice: str | JsonObject
) -> list[ToolCall]:
    """The calls of an answer held to ``forced_schema`` (ValueError if it is not: an answer cut
    by max_tokens)."""
    named = chosen_function(tool_choice, tool_names(tools))
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"the tool call is not complete JSON ({err}); raise max_tokens") from err
    if named is not None:
        return [ToolCall(named, json.dumps(value, ensure_ascii=False), new_call_id())]
    return [
        ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False), new_call_id())
        for call in value
    ]


def calls_before_cut(text: str, tools: list[JsonObject]) -> list[ToolCall]:
    """The complete calls at the head of a ``required`` answer cut short (by max_tokens or the
    context's end: a small model may repeat its call until then): each whole item of the array
    before the cut, in order. The grammar held every item to one offered function's schema, so
    each is a call the client can make; an item that is not (an answer not so held) ends the
    list there."""
    decoder = json.JSONDecoder()
    names = set(tool_names(tools))
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return []
    calls: list[ToolCall] = []
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\n\r,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return calls
        if not isinstance(item, dict) or item.get("name") not in names:
            return calls
        arguments = item.get("parameters")
        if not isinstance(arguments, dict):
            return calls
        text_of_arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(item["name"], text_of_arguments, new_call_id()))


# -- the model families' formats, for tool_choice "auto" -------------------------------------
def _call_of(obj: object) -> ToolCall | None:
    """A ``{"name", "arguments" | "parameters"}`` object as a call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedAnswer:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text before
    the first is the content."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedAnswer(text, [])
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call_of(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return ParsedAnswer(text, [])  # a malformed call: the answer stays text
        calls.append(call)
    content = text[:start].strip() or None
    return ParsedAnswer(content, calls)


def parse_llama3_json(text: str) -> ParsedAnswer:
    """Llama 3's format: the whole answer one JSON object (or several joined by ``;``), after
    an optional ``<|python_tag|>``."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedAnswer(text, [])
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return ParsedAnswer(text, [])
        call = _call_of(obj)
        if call is None:
            return ParsedAnswer(text, [])
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return ParsedAnswer(None, calls)


def parse_mistral(text: str) -> ParsedAnswer:
    """Mistral's ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedAnswer(text, [])
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start + len("[TOOL_CALLS]") :].lstrip())
    except json.JSONDecodeError:
        return ParsedAnswer(text, [])
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item) for item in items]
    if not calls or any(c is None for c in calls):
        return ParsedAnswer(text, [])
    return ParsedAnswer(text[:start].strip() or None, [c for c in calls if c is not None])


TOOL_PARSERS: dict[str, Callable[[str], ParsedAnswer]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}


def parser_for_template(template: str | None) -> str:
    """The format a chat template's own tool instructions ask for (Hermes when it says
    nothing: the format this server's own tool prompt teaches)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def hermes_tool_prompt(tools: list[JsonObject]) -> str:
    """A system message teaching the Hermes format, for a chat template that ignores tools
    (otherwise the model would never learn they exist)."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query.\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def with_tool_prompt(messages: list[JsonObject], tools: list[JsonObject]) -> list[JsonObject]:
    """`messages` with `hermes_tool_prompt` as their system message: added after the text of
    one already there, or as a first message of its own."""
    prompt = hermes_tool_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{prompt}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
