"""One HTTP call's life on the engine: submit its requests to the engine loop, wait until the
loop has queued them (so a bad prompt is still a 400), then collect the whole answer or stream
it as OpenAI's chunks. A conversation is rendered through its chat template first, on the
renderer's threads (within the renderer's bounds), never on the engine's.

A client that goes away has its requests aborted at once: a stream's generator is cancelled
by Starlette when the connection drops, and a call that collects the whole answer has a task
that waits for the connection's http.disconnect message (which the server sends when the
socket closes, however busy the engine keeps the call's queue)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from runner.engine.requests.outputs import RequestOutput
from runner.sampling.prompt_bytes import check_prompt_bytes
from runner.serve.engine_loop import EngineLoop
from runner.serve.events import Accepted, Delta, Done, Event, Rejected, Submission
from runner.serve.json_types import JSONBody
from runner.serve.protocol import field_named
from runner.serve.responses import error_body, sse, usage_of

DISCONNECT_POLL_S = 0.25  # how often a call with nothing new looks whether its client left
KEEPALIVE_S = 0.5  # a stream that holds its text (a tool call being read) says so this often
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: every client skips it; a proxy sees bytes


class ClientGone:
    """Put on a call's queue when its client disconnected: the call ends there."""


class CallError(Exception):
    """A call that ends with an HTTP error: its status and OpenAI error object."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param)


class ClientLeft(CallError):
    """The client closed the connection: its requests are aborted, and the answer (nginx's
    499) goes nowhere. An error the app answers, not a CancelledError, which uvicorn logged
    with its traceback as a failure of the server."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", "client_disconnected")


@dataclass
class Call:
    """The engine requests of one HTTP call and the queue their events arrive on."""

    engine: EngineLoop
    request: Request
    submissions: list[Submission]
    prompt_param: str  # the field a rejected prompt is reported under
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    events: asyncio.Queue[Event | ClientGone] = field(default_factory=asyncio.Queue)
    open: set[int] = field(default_factory=set)  # indexes of requests not yet Done

    async def start(self) -> None:
        """Submit every request and wait until each is queued; CallError 400 if one is
        refused (the others are then aborted)."""
        for sub in self.submissions:
            if sub.messages is not None and sub.prompt is None:
                try:
                    sub.prompt = await self.engine.renderer.render_async(
                        sub.messages, sub.template_kwargs, sub.tools
                    )
                except ValueError as err:
                    param = field_named(str(err), self.prompt_param)
                    if "chat_template" in (sub.template_kwargs or {}):  # the client's own
                        param = "chat_template_kwargs.chat_template"
                    raise CallError(400, str(err), "invalid_request_error", param) from err
            limit = self.engine.max_prompt_bytes
            if isinstance(sub.prompt, str) and limit is not None:
                try:
                    context = self.engine.max_model_len
                    check_prompt_bytes(self.prompt_param, sub.prompt, limit, context)
                except ValueError as err:
                    message, param = str(err), self.prompt_param
                    raise CallError(400, message, "invalid_request_error", param) from None
        self.engine.submit(self.submissions, self.events.put_nowait)  # run in this loop
        self.open = {s.index for s in self.submissions}
        accepted, early = 0, []
        try:
            while accepted < len(self.submissions):
                event = await self.next_event()
                if isinstance(event, Accepted):
                    accepted += 1
                elif isinstance(event, Rejected):
                    self.open.discard(event.index)
                    param = field_named(event.message, self.prompt_param)
                    raise CallError(400, event.message, "invalid_request_error", param)
                else:
                    early.append(event)
        except BaseException:
            self.abort()
            raise
        for event in early:  # deltas that came before the last request was queued
            self.events.put_nowait(event)

    async def next_event(self) -> Event:
        """The next event; if the client disconnects meanwhile, abort and raise ClientLeft."""
        while True:
            try:
                event = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await self.request.is_disconnected():
                    event = ClientGone()
                else:
                    continue
            if isinstance(event, ClientGone):
                self.abort()
                raise ClientLeft()
            return event

    async def _watch_disconnect(self) -> None:
        """Wait for the client to go away, then end the call (its body is read already, so
        the next ASGI message is http.disconnect, sent when the socket closes)."""
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.events.put_nowait(ClientGone())

    def abort(self) -> None:
        """Abort the requests still running (a no-op once every one is Done)."""
        ids = [s.request_id for s in self.submissions if s.index in self.open]
        if ids:
            self.engine.abort(ids)
        self.open.clear()

    async def outputs(self) -> list[RequestOutput]:
        """Every request's output, in index order; CallError 500 if one failed."""
        done: dict[int, RequestOutput] = {}
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            while self.open:
                event = await self.next_event()
                if isinstance(event, Done):
                    self.open.discard(event.index)
                    done[event.index] = event.output
                    if event.output.finish_reason == "error":
                        raise CallError(
                            500, f"request failed: {event.output.error}", "server_error"
                        )
        finally:
            watcher.cancel()
            self.abort()
        return [done[i] for i in sorted(done)]

    async def stream(
        self,
        chunks_of: Callable[[Delta], list[JSONBody]],
        first_chunks: list[JSONBody],
        usage_chunk: Callable[[JSONBody], JSONBody] | None,
        keepalive_s: float = KEEPALIVE_S,
    ) -> AsyncIterator[str]:
        """The SSE body: `first_chunks`, the chunks of each delta, a request's failure as an error
        event, the usage chunk when asked for, then [DONE]. While the deltas give nothing to
        send (an `auto` tool call's text is held until it can be read whole), a keep-alive
        comment goes out every `keepalive_s`: before, a router's idle timeout took a replica
        still generating for a dead one. Closed early (the client went away), it aborts what
        still runs."""
        done: list[RequestOutput] = []
        try:
            for chunk in first_chunks:
                yield sse(chunk)
            sent = time.monotonic()
            while self.open:
                try:
                    event = await self.next_event()
                except ClientLeft:
                    return  # nobody to send the rest to
                if isinstance(event, Delta):
                    chunks = chunks_of(event)
                    for chunk in chunks:
                        yield sse(chunk)
                    now = time.monotonic()
                    if chunks:
                        sent = now
                    elif now - sent >= keepalive_s:
                        sent = now
                        yield KEEPALIVE
                elif isinstance(event, Done):
                    self.open.discard(event.index)
                    done.append(event.output)
                    if event.output.finish_reason == "error":
                        message = f"request failed: {event.output.error}"
                        yield sse(error_body(message, "server_error"))
            if usage_chunk is not None:
                yield sse(usage_chunk(usage_of(done)))
            yield sse("[DONE]")
        finally:
            self.abort()


async def start_call(
    engine: EngineLoop, request: Request, subs: list[Submission], param: str
) -> Call:
    """A call of `subs`, each named after it, started: queued on the engine, or CallError."""
    call = Call(engine, request, subs, param)
    for sub in subs:
        sub.request_id = f"{call.id}-{sub.index}"
    await call.start()
    return call
