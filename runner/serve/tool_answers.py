"""A chat answer read for tool calls, whole or as it streams, as the `openai` client expects
them: `message.tool_calls` (content None when the answer is only calls) and finish_reason
"tool_calls"; streamed, `delta.tool_calls[i]` with its index, id, type and function (name,
then the arguments, which may come in pieces).

How the text is read depends on the request's tool mode (runner/serve/tool_calls.py):
* "named": the whole answer is the function's arguments (held to their schema), so it
  streams as they arrive: one delta with the call's id and name, then argument pieces;
* "required": the answer is a JSON array of calls (held to its schema), sent as one delta per
  call once complete;
* "auto": the model's own format (its parser). Text streams until the format's opening marker
  could be starting; from there it is held and parsed at the end (one delta per call), or
  sent as text if it was no well-formed call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.serve.tool_calls import (
    TOOL_PARSERS,
    ParsedAnswer,
    ToolCall,
    calls_before_cut,
    forced_calls,
    new_call_id,
)

JsonObject = dict[str, Any]
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
PYTHON_TAG = "<|python_tag|>"  # Llama 3's: a call may follow it


@dataclass(frozen=True)
class ToolPlan:
    """How one request's answers are read: its mode ("auto", "required" or "named"), the tools
    it offered, its tool_choice, and the parser of the model's format (for "auto")."""

    mode: str
    tools: list[JsonObject]
    tool_choice: str | JsonObject | None
    parser: str

    def answer(self, text: str) -> ParsedAnswer:
        """The whole answer's text and calls. A "required" answer cut short (by max_tokens or
        the context's end) gives the calls it completed, its finish_reason staying "length";
        one that completed none, and any other answer that is no complete call, stays text."""
        if self.mode == "auto":
            return TOOL_PARSERS[self.parser](text)
        try:
            return ParsedAnswer(None, forced_calls(text, self.tools, self.tool_choice or ""))
        except (ValueError, KeyError, TypeError):
            made = calls_before_cut(text, self.tools) if self.mode == "required" else []
            return ParsedAnswer(None, made) if made else ParsedAnswer(text, [])

    def stream(self) -> ToolStream:
        return ToolStream(self)


def tool_call_delta(index: int, call: ToolCall) -> JsonObject:
    """A whole call as one streamed `delta.tool_calls` entry."""
    entry = call.as_openai()
    return {"index": index, **entry}


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's finish_reason for an answer that made `calls` calls: "tool_calls" when it
    ended by itself with calls; else the engine's."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass
class ToolStream:
    """One sample's streamed answer, read for calls: `feed` each new piece of text, `end` at
    the last; each returns the chunk deltas to send now."""

    plan: ToolPlan
    held: str = ""  # text not sent yet
    started: bool = False  # auto: the held text is (maybe) a call, held to the end
    free: bool = False  # auto, Llama 3: the answer began as text, so it is no call
    calls: int = 0
    call_id: str = field(default_factory=new_call_id)

    def feed(self, text: str) -> list[JsonObject]:
        if self.plan.mode == "named":
            return self._named(text)
        if self.free:
            return [{"content": text}] if text else []
        self.held += text
        if self.plan.mode == "required" or self.started:
            return []
        send = self._auto_free_text()
        return [{"content": send}] if send else []

    def end(self) -> list[JsonObject]:
        """The deltas that complete the answer: its held calls, or its held text."""
        if self.plan.mode == "named" or not self.held:
            return []
        parsed = self.plan.answer(self.held)
        self.held = ""
        deltas: list[JsonObject] = []
        if parsed.content:
            deltas.append({"content": parsed.content})
        if parsed.calls:
            calls = [tool_call_delta(i, c) for i, c in enumerate(parsed.calls, self.calls)]
            self.calls += len(parsed.calls)
            deltas.append({"tool_calls": calls})
        return deltas

    def _named(self, text: str) -> list[JsonObject]:
        """The named function's arguments, piece by piece, after one delta naming it."""
        deltas: list[JsonObject] = []
        if not self.calls:
            self.calls = 1
            name = _function_name(self.plan.tool_choice)
            head = {"index": 0, "id": self.call_id, "type": "function"}
            head["function"] = {"name": name, "arguments": ""}
            deltas.append({"tool_calls": [head]})
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    def _auto_free_text(self) -> str:
        """The held text that surely is no part of a call (sent now); from the format's
        marker on, the rest is held to the end."""
        parser = self.plan.parser
        if parser == "llama3_json":  # a call is the whole answer: decided by its start
            start = self.held.lstrip()
            if start.startswith(("{", PYTHON_TAG)):
                self.started = True
                return ""
            if not start or PYTHON_TAG.startswith(start):
                return ""  # too soon to say
            self.free = True  # no call: the rest is plain text
            send, self.held = self.held, ""
            return send
        marker = MARKERS[parser]
        at = self.held.find(marker)
        if at >= 0:
            self.started = True
            send, self.held = self.held[:at], self.held[at:]
            return send
        keep = _partial_marker(self.held, marker)
        send, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return send


def _partial_marker(text: str, marker: str) -> int:
    """How many of `text`'s last characters could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _function_name(tool_choice: str | JsonObject | None) -> str:
    function = tool_choice.get("function", {}) if isinstance(tool_choice, dict) else {}
    return str(function.get("name", ""))
