"""Chat templates rendered for the server: on threads of their own (never the engine's thread,
which every stream waits on, nor the event loop), each render bounded in time and in the size
of the text it builds.

A jinja template is a program: two nested loops of some thousands freeze every stream for
seconds on the engine thread, three hang it, and a template that doubles a string builds tens of
megabytes in a fraction of a second. A thread cannot be killed, so the bound is kept from
inside: while a render runs, its thread has a trace function on the template's own frames (jinja
compiles a template to Python code named "<template>"), which at each line looks at the clock
and at the strings the template holds, and stops the render when either is past its bound.
Frames outside the template are not traced, and the text rendered is the same as without the
bound. What is not bounded: one C-level operation inside a line (a single `"x" * n` builds its
string before the next line is seen), which only a template the server trusts
(`--trust-request-chat-template`) or its own can contain.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType
from typing import TypeAlias

from jinja2.utils import Namespace

from runner.serve.json_types import JSONObject
from runner.serve.messages import JsonObject
from runner.serve.tool_calls import with_tool_prompt

TEMPLATE_FILENAME = "<template>"  # jinja's name for the code of a template made from a string
RENDER_THREADS = 2
YIELD_EVERY = 64  # template lines between two hand-overs of the interpreter's lock

Messages = list[JsonObject]  # as template_messages gives them
Render = Callable[[Messages, dict[str, object] | None], str]  # the engine's apply_chat_template
# sys.settrace's trace function: called with a frame, an event and its argument, it gives the
# trace function for the frame's lines (None: none).
Tracer: TypeAlias = "Callable[[FrameType, str, object], Tracer | None]"


@dataclass(frozen=True)
class RenderBounds:
    """How long one render may take and how many characters any string it builds (the
    prompt among them) may hold."""

    time_s: float = 5.0
    max_chars: int = 8_000_000


class _OverBound(BaseException):
    """Raised inside a render by its trace function. A BaseException, so neither the
    template's nor the tokenizer's `except Exception` takes it for a template error."""


class ChatRenderer:
    """Renders conversations through `render` (the engine's apply_chat_template) on its own
    threads, within `bounds`."""

    def __init__(self, render: Render, bounds: RenderBounds | None = None) -> None:
        self.render = render
        self.bounds = bounds or RenderBounds()
        self._pool = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="kvcache-template")

    async def render_async(
        self,
        messages: Messages,
        template_kwargs: Mapping[str, object] | None,
        tools: list[JSONObject] | None = None,
    ) -> str:
        """The prompt text; ValueError naming the bound a render went past, or what the
        template rejected."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self.render_with_tools, messages, template_kwargs, tools
        )

    def render_with_tools(
        self,
        messages: Messages,
        template_kwargs: Mapping[str, object] | None,
        tools: list[JSONObject] | None,
    ) -> str:
        """The prompt with the `tools` a request offers: a template that shows tools gets
        them as `tools` (as vLLM passes them); one that ignores them (the same text with and
        without) gets a system message teaching the Hermes format instead, or the model would
        never learn they exist."""
        if not tools:
            return self.render_bounded(messages, template_kwargs)
        options = dict(template_kwargs or {})
        shown = self.render_bounded(messages, {**options, "tools": tools})
        if shown != self.render_bounded(messages, options):
            return shown
        return self.render_bounded(with_tool_prompt(messages, tools), options)

    def render_bounded(
        self, messages: Messages, template_kwargs: Mapping[str, object] | None
    ) -> str:
        """Render on the calling thread, within the bounds (what the pool's threads run)."""
        bounds = self.bounds
        previous = sys.gettrace()
        sys.settrace(_tracer(time.monotonic() + bounds.time_s, bounds))
        try:
            text = self.render(messages, None if template_kwargs is None else dict(template_kwargs))
        except _OverBound as over:
            raise ValueError(str(over)) from None
        finally:
            sys.settrace(previous)
        if len(text) > bounds.max_chars:
            raise ValueError(_size_message(bounds))
        return text

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _size_message(bounds: RenderBounds) -> str:
    return (
        f"chat template: what it built went past {bounds.max_chars} characters "
        "(the server's bound on a template's output)"
    )


def _size(value: object) -> int:
    """A template value's size: a string's characters, a container's items, and for a
    jinja namespace (`{% set ns.s = ns.s ~ ns.s %}`) the largest of its values."""
    if isinstance(value, str | list | tuple | dict):
        return len(value)
    if isinstance(value, Namespace):
        held = getattr(value, "_Namespace__attrs", {})  # the one name it shows as itself
        return max((_size(v) for v in held.values() if not isinstance(v, Namespace)), default=0)
    return 0


def _tracer(deadline: float, bounds: RenderBounds) -> Tracer:
    """A trace function that follows only template frames, and in them stops the render
    past `deadline` or once a string of the template holds more than `bounds.max_chars`.
    Every YIELD_EVERY lines it lets go of the interpreter's lock: a render that keeps it
    for its whole switch interval (5 ms) makes the engine thread, which takes it back after
    each device call, wait that long each time (a stream's gaps grew several
    times beside a long render)."""
    lines = 0

    def in_template(frame: FrameType, event: str, arg: object) -> Tracer | None:
        nonlocal lines
        if event == "line":
            lines += 1
            if lines % YIELD_EVERY == 0:
                time.sleep(0)
            if time.monotonic() > deadline:
                raise _OverBound(
                    f"chat template: rendering took over {bounds.time_s:g} s "
                    "(the server's bound on a template's time)"
                )
            if any(_size(v) > bounds.max_chars for v in frame.f_locals.values()):
                raise _OverBound(_size_message(bounds))
        return in_template

    def on_call(frame: FrameType, event: str, arg: object) -> Tracer | None:
        return in_template if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    return on_call
