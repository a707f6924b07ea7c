"""A chat request's messages, as OpenAI's API and vLLM's server take them, and the dicts the
chat template is given: text parts joined into one string, "developer" read as "system", a
tool's answer (role "tool", with its tool_call_id) and an assistant's earlier tool calls
(`tool_calls`, its content None, "" or left out) passed on as vLLM passes them: each call's
`arguments` JSON text parsed into the object templates index into, and a missing content given
to the template as "" (vLLM's rendering; a template that adds `content` to a string would fail
on None)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

JsonObject = dict[str, Any]


class Lenient(BaseModel):
    """A request body (or part of one) as vLLM reads it: a field it does not know is kept
    aside (`model_extra`), warned about once and ignored, never a 400. A known field with a
    bad value is still refused, naming it. Python's json (which reads the body) takes NaN and
    Infinity: refused as not finite, never compared with a range."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The dotted names of the fields `model` and the models inside it did not know."""
    names = [f"{prefix}{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                at = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                names += unknown_fields(item, at)
    return names


class ContentPart(Lenient):
    type: Literal["text", "input_text"]
    text: str


class FunctionCall(Lenient):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class MessageToolCall(Lenient):
    """One call of an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines, as vLLM joins them)."""
        content = self.content
        if content is None or isinstance(content, str):
            return content
        return "\n".join(part.text for part in content)

    def as_template_message(self) -> JsonObject:
        """The dict chat templates read (what the router hashes a conversation by)."""
        return template_message(self, 0)


def template_message(message: ChatMessage, index: int) -> JsonObject:
    """`message` as the chat template gets it; ValueError naming messages[index] for a
    message without content that is not the assistant's (OpenAI lets an assistant's message,
    with or without tool calls, leave its content out or null; vLLM renders it as "")."""
    text = message.text()
    if text is None and message.role != "assistant":
        raise ValueError(
            f"messages[{index}].content: needed (only an assistant's message may come without it)"
        )
    role = "system" if message.role == "developer" else message.role
    out: JsonObject = {"role": role, "content": text or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    return out


def _arguments(text: str) -> object:
    """A call's arguments as templates read them: the parsed object (what vLLM gives them),
    or the text itself when it is not JSON (a model's malformed call is history, not the
    client's error)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_messages(messages: list[ChatMessage]) -> list[JsonObject]:
    return [template_message(m, i) for i, m in enumerate(messages)]
