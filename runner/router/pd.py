"""The disaggregated router: `kvcache router --prefill URL ... --decode URL ...`. Each request
goes to a prefill worker (POST /kvcache/prefill/v1/...?early=1: the prompt and its first
token, as vLLM's proxy sends max_tokens 1), whose answer is the handover's kv_transfer_params;
then to a decode worker, which pulls the blocks (POST /kvcache/pull) and answers the request
itself (POST /v1/...), streamed back as it comes. The prefill worker sends the open handover's
params first, as soon as the request is queued: the pull runs beside the prefill, and when it
ends only its last blocks are left to send. Each worker is picked by what it has cached of the
prompt and its load (worker_choice.py).

Faults: a worker that cannot be reached (or is draining) before it answered is taken out and
the step retried on another; when no prefill worker is left the request fails with 503, and
when no decode worker is left the prefill worker is told to release the handover. A decode
worker that dies (or goes silent past the upstream timeouts) mid-answer ends the stream with
an error event (a whole answer: 502, or 504), as runner/router/relay.py does for the replicas'
router; a prefill worker that dies mid-answer fails the request with 502."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runner.router.bodies import read_body
from runner.router.pd_messages import KVTransferParams, PrefillLine, PullAnswer
from runner.router.proxy import RouterSettings, forwarded_headers, proxy_app, upstream_client
from runner.router.relay import Hooks, Timeouts, UpstreamSilent, post, relay
from runner.router.replicas import Replica, ReplicaSet
from runner.router.worker_choice import PromptTokens, WorkerChoice
from runner.serve.json_types import JSONBody, JSONObject
from runner.serve.responses import error_body


class Unavailable(Exception):
    """No worker of a kind could take the step (all down or draining)."""


class PDRouter:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        settings: RouterSettings,
        client: httpx.AsyncClient,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("a disaggregated router needs --prefill and --decode workers")
        self.prefill = ReplicaSet(prefill, client, settings.health_interval_s)
        self.decode = ReplicaSet(decode, client, settings.health_interval_s)
        self.settings, self.client = settings, client
        self.timeouts = Timeouts.of(settings)
        self.prefill_choice, self.decode_choice = WorkerChoice(settings), WorkerChoice(settings)
        self.prompt_tokens = PromptTokens(settings.tokenizer)  # for prefill_choice
        self.counts = {"requests": 0, "prefill_failed": 0, "decode_failed": 0, "released": 0}
        # after_prefill_ms: from the prefill's answer to the end of the pull (what the handover
        # adds to a request's time; the rest of the pull ran beside its prefill).
        self.handover = {"blocks": 0, "bytes": 0, "pull_ms": 0.0, "publish_ms": 0.0}
        self.handover |= {"after_prefill_ms": 0.0}

    async def check_all(self) -> None:
        await asyncio.gather(self.prefill.check_all(), self.decode.check_all())

    async def run_health_checks(self) -> None:
        await asyncio.gather(self.prefill.run_health_checks(), self.decode.run_health_checks())

    async def _post_prefill(
        self, path: str, body: JSONObject, headers: dict[str, str]
    ) -> tuple[Replica, httpx.Response]:
        """POST to a prefill worker (worker_choice.py), retried on another when one cannot be
        reached or is draining. Raises Unavailable."""
        workers, tokens = self.prefill, None
        # With one prefill worker there is no choice to make: its prompt is not tokenized.
        if self.prefill_choice.policy.uses_prefixes and len(workers.healthy()) > 1:
            tokens = await self.prompt_tokens.of(path, body, workers.replicas)
        tried: set[str] = set()
        for _ in range(self.settings.max_attempts):
            candidates = workers.healthy(exclude=tried)
            if not candidates:
                break
            worker = self.prefill_choice.choose(candidates, tokens, body.get("cache_salt"))
            worker.sent += 1
            worker.in_flight += 1
            try:
                url = f"{worker.url}/kvcache/prefill{path}?early=1"
                upstream = self.client.build_request("POST", url, json=body, headers=headers)
                response: httpx.Response | None = await self.client.send(upstream, stream=True)
            except httpx.TransportError:
                response = None
            finally:
                worker.in_flight -= 1
            if response is None or response.status_code == 503:
                if response is not None:
                    await response.aclose()
                workers.mark_dead(worker)
                tried.add(worker.url)
                continue
            return worker, response
        raise Unavailable

    async def _prefill_answers(
        self, answer: httpx.Response, headers: dict[str, str]
    ) -> tuple[PrefillLine, tuple[Replica, asyncio.Task[httpx.Response]] | None]:
        """Read a prefill worker's answer lines: (its last line, the pull started on a decode
        worker when the first line was an open handover's params). Raises httpx.TransportError
        (or ValueError) when the prefill worker died mid-answer."""
        lines = answer.aiter_lines()
        first: PrefillLine = json.loads(await anext(lines))
        params = first.get("kv_transfer_params") or {}
        if "prefill" in first or not params.get("open"):
            return first, None
        pulling = self._start_pull(params, headers)
        try:
            return json.loads(await anext(lines)), pulling
        except BaseException:
            await self._drop_pull(pulling)
            raise

    def _start_pull(
        self, params: KVTransferParams, headers: dict[str, str], tried: set[str] | None = None
    ) -> tuple[Replica, asyncio.Task[httpx.Response]] | None:
        """POST the handover's params to a decode worker (worker_choice.py), in the
        background."""
        candidates = self.decode.healthy(exclude=tried or set())
        if not candidates:
            return None
        tokens, salt = params.get("prompt_token_ids"), params.get("cache_salt")
        worker = self.decode_choice.choose(candidates, tokens, salt)
        worker.sent += 1
        worker.in_flight += 1
        pull = self.client.post(f"{worker.url}/kvcache/pull", json=params, headers=headers)
        return worker, asyncio.ensure_future(pull)

    async def _drop_pull(
        self, pulling: tuple[Replica, asyncio.Task[httpx.Response]] | None
    ) -> None:
        if pulling is not None:
            worker, task = pulling
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            worker.in_flight -= 1

    async def forward(self, path: str, request: Request) -> Response:
        self.counts["requests"] += 1
        _, body = await read_body(request)  # else a 400 (runner/router/bodies.py)
        headers = forwarded_headers(request, self.settings)
        try:
            prefill, answer = await self._post_prefill(path, body, headers)
        except Unavailable:
            self.counts["prefill_failed"] += 1
            message = "no prefill worker could take the request (all are down or draining)"
            return JSONResponse(error_body(message, "service_unavailable"), 503)
        try:
            if answer.status_code != 200:  # the client's 400, a 429
                content = await answer.aread()
                return Response(content, answer.status_code, media_type="application/json")
            last, pulling = await self._prefill_answers(answer, headers)
        except (httpx.TransportError, StopAsyncIteration, ValueError):
            self.counts["prefill_failed"] += 1
            message = "the prefill worker died before it answered"
            return JSONResponse(error_body(message, "server_error"), 502)
        finally:
            await answer.aclose()
        if "kv_transfer_params" not in last or "prefill" not in last:  # a failed prefill
            await self._drop_pull(pulling)
            return JSONResponse(last, 500)
        params = last["kv_transfer_params"]
        self.handover["publish_ms"] += float(params.get("publish_ms", 0.0))
        ended = time.perf_counter()
        try:
            return await self._decode(path, body, headers, params, pulling, ended)
        except Unavailable:
            self.counts["decode_failed"] += 1
            await self._release(prefill, params["handover_id"], headers)
            message = "no decode worker could take the request (all are down or draining)"
            return JSONResponse(error_body(message, "service_unavailable"), 503)

    async def _decode(
        self,
        path: str,
        body: JSONObject,
        headers: dict[str, str],
        params: KVTransferParams,
        pulling: tuple[Replica, asyncio.Task[httpx.Response]] | None,
        ended: float,
    ) -> Response:
        """Pull (or finish the pull started beside the prefill), then the request itself."""
        tried: set[str] = set()
        for _ in range(self.settings.max_attempts):
            if pulling is None:
                pulling = self._start_pull(params, headers, tried)
                if pulling is None:
                    break
            (worker, task), pulling = pulling, None
            silent = False
            try:
                pulled = await task
                self.handover["after_prefill_ms"] += 1000 * (time.perf_counter() - ended)
                if pulled.status_code == 200:
                    sent_at = time.monotonic()
                    response = await post(
                        self.client, worker.url + path, self.timeouts, headers, body
                    )
                    if response.status_code != 503:
                        self._count(pulled.json())
                        return await self._relay(worker, response, sent_at)
                    await response.aclose()
                elif pulled.status_code != 503:
                    worker.in_flight -= 1
                    return Response(
                        pulled.content, pulled.status_code, media_type="application/json"
                    )
            except httpx.TransportError:
                pass
            except UpstreamSilent:
                silent = True
            worker.in_flight -= 1
            (self.decode.mark_silent if silent else self.decode.mark_dead)(worker)
            tried.add(worker.url)
        raise Unavailable

    def _count(self, pulled: PullAnswer) -> None:
        self.handover["blocks"] += int(pulled.get("blocks", 0))
        self.handover["bytes"] += int(pulled.get("bytes", 0))
        self.handover["pull_ms"] += float(pulled.get("ms", 0.0))

    async def _release(self, prefill: Replica, handover_id: str, headers: dict[str, str]) -> None:
        """Tell the prefill worker its handover will not be pulled (best effort: unreleased,
        it expires there)."""
        with contextlib.suppress(httpx.HTTPError):
            url, body = f"{prefill.url}/kvcache/release", {"handover_id": handover_id}
            await self.client.post(url, json=body, headers=headers)
            self.counts["released"] += 1

    async def _relay(self, worker: Replica, response: httpx.Response, sent_at: float) -> Response:
        """The decode worker's answer, relayed as the replicas' router relays one."""

        def failed(err: Exception) -> None:
            self.counts["decode_failed"] += 1
            if isinstance(err, UpstreamSilent):
                self.decode.mark_silent(worker)
            else:
                self.decode.mark_dead(worker)

        def end() -> None:
            worker.in_flight -= 1

        hooks = Hooks("the decode worker", lambda: None, end, failed)
        return await relay(response, sent_at, self.timeouts, hooks)

    def stats(self) -> JSONBody:
        def workers(rs: ReplicaSet) -> list[JSONBody]:
            return [
                {"url": r.name, "healthy": r.healthy, "in_flight": r.in_flight, "sent": r.sent}
                for r in rs.replicas
            ]

        return {
            **self.counts,
            "handover": dict(self.handover),
            "prefill": workers(self.prefill),
            "decode": workers(self.decode),
            "prefill_routes": dict(self.prefill_choice.reasons),
            "decode_routes": dict(self.decode_choice.reasons),
        }


def build_pd_router_app(prefill: list[str], decode: list[str], settings: RouterSettings) -> FastAPI:
    """The disaggregated router's app; its health loop runs from startup to shutdown."""
    client = upstream_client(settings)
    router = PDRouter(prefill, decode, settings, client)
    title = "kvcache router (prefill/decode)"
    health_loop = router.run_health_checks
    app = proxy_app(title, router, client, router.check_all, health_loop, settings.api_key)

    @app.get("/health")
    async def health() -> Response:
        up = bool(router.prefill.healthy()) and bool(router.decode.healthy())
        return JSONResponse({"status": "ok" if up else "down"}, 200 if up else 503)

    @app.get("/router/stats", response_model=None)
    async def stats() -> JSONBody:
        return router.stats()

    return app
