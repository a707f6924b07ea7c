"""One upstream answer relayed to the client, as both routers do it (the replicas' router and
the prefill/decode one's decode step), with the upstream timeouts and what a client sees when
the upstream fails.

Timeouts (`--upstream-*-timeout`): connecting (httpx's own); the first output, from sending
the request to the first event that carries generated text (a whole answer: its response,
which comes with the whole answer), so a queue wait, a long prefill and a long non-streamed
generation all fit in it; then the longest silence between two chunks, so a stream stays
alive for as long as its tokens keep coming, however long it runs.

Failures after the answer began: a stream ends with an OpenAI error event and `[DONE]` (what
the openai client raises as an APIError), never silently, so a cut answer cannot pass for a
whole one; only whole events are passed on, so the error event never lands inside a cut one.
A whole answer cut short is a 502 (the upstream died) or 504 (it went silent), in OpenAI's
error shape. The caller's hooks take the upstream out of rotation and free its work."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runner.router.load import FirstToken
from runner.router.proxy import RouterSettings
from runner.serve.json_types import JSONObject
from runner.serve.responses import error_body, sse


class UpstreamSilent(Exception):
    """The upstream sent nothing within a timeout (the message names it and its flag)."""


@dataclass(frozen=True)
class Timeouts:
    connect_s: float
    first_output_s: float
    idle_s: float

    @classmethod
    def of(cls, settings: RouterSettings) -> Timeouts:
        return cls(
            settings.connect_timeout_s, settings.first_output_timeout_s, settings.idle_timeout_s
        )

    def first_output_message(self) -> str:
        return f"no output within {self.first_output_s:g} s (--upstream-first-output-timeout)"

    def idle_message(self) -> str:
        return f"nothing for {self.idle_s:g} s (--upstream-idle-timeout)"

    def for_httpx(self) -> httpx.Timeout:
        """A forwarded request's httpx timeout: httpx bounds the connection only, the relay
        the rest (httpx's read timeout is one number for the headers and every chunk)."""
        return httpx.Timeout(None, connect=self.connect_s)


@dataclass
class Hooks:
    """What a router does as its upstream's answer goes by."""

    who: str  # "the replica", "the decode worker": named in the client's error
    first_output: Callable[[], None]  # the prompt is computed (first text, or the answer)
    end: Callable[[], None]  # the request is over upstream, however it ended (called once)
    failed: Callable[[Exception], None]  # died (an httpx.HTTPError) or UpstreamSilent


async def post(
    client: httpx.AsyncClient,
    url: str,
    timeouts: Timeouts,
    headers: Mapping[str, str],
    body: bytes | JSONObject,
) -> httpx.Response:
    """POST `body` (raw bytes, or a JSON object) to the upstream: its response, the body not
    read yet. Raises httpx.TransportError (it could not be reached, or closed the connection
    without answering) or UpstreamSilent (no answer within the first-output timeout)."""
    content, json = (body, None) if isinstance(body, bytes) else (None, body)
    request = client.build_request(
        "POST", url, content=content, json=json, headers=headers, timeout=timeouts.for_httpx()
    )
    try:
        async with asyncio.timeout(timeouts.first_output_s):
            return await client.send(request, stream=True)
    except TimeoutError as err:
        raise UpstreamSilent(timeouts.first_output_message()) from err


async def relay(
    response: httpx.Response,
    sent_at: float,
    timeouts: Timeouts,
    hooks: Hooks,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The client's response to `response` (sent at `sent_at`, time.monotonic()): a stream
    passed on event by event as it comes, or a whole answer once read."""
    media_type = response.headers.get("content-type") or ""
    if not media_type.startswith("text/event-stream"):
        hooks.first_output()  # a whole answer's response comes when it is all done
        try:
            async with contextlib.aclosing(_timed(response, timeouts, sent_at, True)) as chunks:
                content = b"".join([chunk async for chunk in chunks])
        except (httpx.HTTPError, UpstreamSilent) as err:
            hooks.failed(err)
            status = 504 if isinstance(err, UpstreamSilent) else 502
            message = _message(hooks.who, err, streaming=False)
            return JSONResponse(error_body(message, "server_error"), status)
        finally:
            await response.aclose()
            hooks.end()
        return Response(content, response.status_code, headers, media_type or None)

    async def events() -> AsyncIterator[bytes]:
        first, pending, done = FirstToken(), b"", False
        timed = _timed(response, timeouts, sent_at, lambda: first.seen)
        try:
            async with contextlib.aclosing(timed) as chunks:
                async for chunk in chunks:
                    if not first.seen and first.feed(chunk):
                        hooks.first_output()
                    whole, pending = _whole_events(pending + chunk)
                    if whole:
                        done = done or b"data: [DONE]" in whole
                        yield whole
            if pending:
                yield pending  # the upstream's last bytes, as it ended them
        except (httpx.HTTPError, UpstreamSilent) as err:
            hooks.failed(err)  # the cut event (pending) is dropped: it is no event
            if not done:  # after its [DONE] the client has the whole answer
                message = _message(hooks.who, err, streaming=True)
                yield (sse(error_body(message, "server_error")) + sse("[DONE]")).encode()
        finally:  # the client left, or the stream ended: the upstream request ends too
            await response.aclose()
            hooks.end()

    return StreamingResponse(events(), response.status_code, headers, media_type)


async def _timed(
    response: httpx.Response,
    timeouts: Timeouts,
    sent_at: float,
    started: bool | Callable[[], bool],
) -> AsyncGenerator[bytes, None]:
    """The response's raw chunks; raises UpstreamSilent when the next one takes longer than
    the time left for the first output (until `started()`), else the idle timeout."""
    chunks = response.aiter_raw()
    while True:  # ends with the response's body
        began = started if isinstance(started, bool) else started()
        if began:
            wait, message = timeouts.idle_s, timeouts.idle_message()
        else:
            wait = sent_at + timeouts.first_output_s - time.monotonic()
            message = timeouts.first_output_message()
        try:
            async with asyncio.timeout(max(wait, 0.0)):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError as err:
            raise UpstreamSilent(message) from err
        yield chunk


def _whole_events(data: bytes) -> tuple[bytes, bytes]:
    """(the complete server-sent events at the start of `data`, the rest)."""
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := data.rfind(sep)) >= 0]
    cut = max(ends, default=0)
    return data[:cut], data[cut:]


def _message(who: str, err: Exception, streaming: bool) -> str:
    if isinstance(err, UpstreamSilent):
        return f"{who} went silent before its answer ended: {err}"
    where = "mid-stream" if streaming else "before its answer ended"
    return f"{who} died {where} ({type(err).__name__})"
