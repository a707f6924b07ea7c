"""One thread that owns the engine: it takes requests and aborts as they arrive, steps the
engine while anything runs (a request that arrives joins the batch at the next step:
continuous batching over HTTP), and hands each request's new tokens and text to the sink its
HTTP handler gave (which puts them on the handler's asyncio queue).

Every engine call happens on this thread, so the HTTP event loop never waits for a step; the
handlers only put commands in the inbox. Text deltas are made as
runner/engine/api/streaming.py makes them (TextStream): they add up to the request's final
text exactly. The events of one step (or one batch of commands) go to the event loop in one
call, so a step of 64 streams costs the HTTP thread one wake-up, not 64: with the GIL shared, a
loop that woke the HTTP thread per token starved it (chunks then left in bursts, and first
tokens late).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from runner.engine.api.interface import EngineInterface
from runner.engine.api.streaming import TextStream
from runner.engine.requests.outputs import RequestOutput
from runner.engine.sequence import Sequence
from runner.sampling.prompt_bytes import max_prompt_bytes
from runner.serve.events import Accepted, Delta, Done, Event, Rejected, Sink, Submission
from runner.serve.masking import Masker
from runner.serve.metrics import ServeMetrics
from runner.serve.templates import ChatRenderer
from runner.serve.vllm_metrics import CacheConfig, request_end

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # how long an idle loop sleeps before it looks at its stop flag again


@dataclass
class _Tracked:
    """A live request as the loop follows it."""

    index: int
    sink: Sink
    seqs: list[Sequence]
    arrival: float  # when its handler submitted it (time.perf_counter)
    texts: dict[int, TextStream] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)  # tokens handed out, per sequence
    ended: set[int] = field(default_factory=set)  # sequences whose last delta is out
    last_token: dict[int, float] = field(default_factory=dict)  # per sequence: its latest


@dataclass(frozen=True)
class _Add:
    """A submission in the inbox, with its handler's sink and its arrival."""

    sub: Submission
    sink: Sink
    arrival: float  # time.perf_counter


# What the inbox carries: a submission, request ids to abort, or None to wake the loop (stop).
_Command = _Add | list[str] | None


class EngineLoop:
    """Owns `llm` from `start` to `stop`: nothing else may call it meanwhile. Its chat
    templates are rendered by `renderer`, on threads of its own (runner/serve/templates.py),
    before a conversation is submitted; the error texts its requests end with pass through
    `masker`."""

    def __init__(
        self,
        llm: EngineInterface,
        metrics: ServeMetrics,
        renderer: ChatRenderer | None = None,
        masker: Masker | None = None,
    ) -> None:
        self._llm = llm
        self._metrics = metrics
        self.renderer = renderer or ChatRenderer(llm.apply_chat_template)
        # A text prompt past this many bytes could never fit: refused before this thread
        # would tokenize it (runner/sampling/prompt_bytes.py).
        tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.max_prompt_bytes = (
            None if tokenizer is None else max_prompt_bytes(tokenizer, llm.max_model_len)
        )
        self._masker = masker or Masker()
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._live: dict[str, _Tracked] = {}  # the loop thread's own
        self._pending_lock = threading.Lock()
        self._pending = 0  # submissions in the inbox
        self._waiting = 0  # published by the loop after each step
        self._stop = threading.Event()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._outbox: list[tuple[Sink, Event]] = []  # the loop thread's, until _flush
        self._thread = threading.Thread(target=self._run, name="kvcache-engine-loop", daemon=True)
        self._pool = llm.kv_pool()
        metrics.describe_cache(
            CacheConfig(
                self._pool.block_size,
                self._pool.num_blocks,
                llm.config.enable_prefix_caching,
                self._pool.dtype_name,
            )
        )

    # ------------------------------------------------------------------ any thread
    def start(self, event_loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the loop thread. With `event_loop`, sinks are called in that loop's thread
        (a batch of events per step); without, in the loop thread itself."""
        self._event_loop = event_loop
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what still runs (each request's sink gets its Done, "abort") and end."""
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self.renderer.close()

    def submit(self, submissions: list[Submission], sink: Sink) -> None:
        """Queue prompts (a conversation's already rendered: Call.start does it)."""
        with self._pending_lock:
            self._pending += sum(_samples(sub) for sub in submissions)
        now = time.perf_counter()  # the requests' arrival, as their latencies count it
        for sub in submissions:
            self._inbox.put(_Add(sub, sink, now))

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their blocks; their sinks hear nothing more."""
        self._inbox.put(list(request_ids))

    def queued(self) -> int:
        """Samples not yet admitted to the batch (a request of n samples counts n): in the
        inbox, or waiting in the scheduler (each sample is a sequence there)."""
        return self._pending + self._waiting

    def live(self) -> int:
        """Requests queued or running (what a drain waits for)."""
        return self._pending + len(self._live)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._take_commands(block=not self._llm.has_unfinished())
            self._flush()
            if not self._llm.has_unfinished():
                # Idle: blocks still waiting for the tiers' write queue go down now, not at
                # the next request's commit (an idle server never wrote them).
                self._llm.write_waiting_blocks()
                continue
            try:
                outputs = self._llm.step()
            except Exception as err:  # noqa: BLE001 - the scheduler itself failed: end all
                self._end_all(f"{type(err).__name__}: {err}")
                self._flush()
                continue
            self._publish(outputs)
            self._flush()
        self._end_all(None)
        self._flush()

    def _deliver(self, sink: Sink, event: Event) -> None:
        self._outbox.append((sink, event))

    def _flush(self) -> None:
        """Hand the events gathered so far to their sinks, in one call to the event loop."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        if self._event_loop is None:
            _run_sinks(batch)
            return
        try:
            self._event_loop.call_soon_threadsafe(_run_sinks, batch)
        except RuntimeError:  # the event loop closed (the server is shutting down)
            pass

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add):
                self._add(command.sub, command.sink, command.arrival)
            elif command is not None:  # request ids to abort
                for request_id in command:
                    tracked = self._live.pop(request_id, None)
                    if tracked is not None:
                        self._llm.abort_request(request_id)
                        self._metrics.requests.labels(finish_reason="abort").inc()
                        self._ended(tracked, "abort")
                self._update_gauges()  # no step may follow: the gauges must not stay behind
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _update_gauges(self) -> None:
        """The gauges as the engine is now: its batch, its queue and its pool."""
        llm = self._llm
        with llm.lock:
            depth = llm.queue_depth()
            self._waiting = depth.waiting
            self._metrics.on_step(
                depth.running,
                self.queued(),
                llm.cache_stats(),
                self._pool.num_blocks,
                depth.preemptions,
                llm.segment_stats(),
            )

    def _add(self, sub: Submission, sink: Sink, arrival: float) -> None:
        with self._pending_lock:
            self._pending -= _samples(sub)
        llm = self._llm
        try:
            if sub.prompt is None:  # never rendered here: a template may run for long
                raise ValueError("messages: the conversation was submitted unrendered")
            seq = llm.add_request(
                sub.prompt,
                sub.params,
                request_id=sub.request_id,
                cache_salt=sub.cache_salt,
                add_special_tokens=sub.messages is None,  # a chat template wrote its own
                priority=sub.priority,
            )
        except ValueError as err:
            self._deliver(sink, Rejected(sub.index, self._masker.mask(str(err))))
            return
        seqs = llm.samples_of(sub.request_id) or [seq]
        if sub.on_queued is not None:
            try:
                sub.on_queued(seqs)
            except Exception:  # noqa: BLE001 - the hook's failure is not the request's
                trace = self._masker.mask(traceback.format_exc())  # it may quote a URL
                log.error("request %s: its on_queued hook failed\n%s", sub.request_id, trace)
        tracked = _Tracked(sub.index, sink, seqs, arrival)
        for s in seqs:
            tracked.texts[s.seq_id] = llm.text_stream(s.params.skip_special_tokens)
            tracked.sent[s.seq_id] = 0
        self._live[sub.request_id] = tracked
        self._waiting = llm.queue_depth().waiting
        self._deliver(sink, Accepted(sub.index))

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """After a step: every live request's deltas, then the Done of each that ended."""
        llm, now = self._llm, time.perf_counter()
        with llm.lock:
            for live in self._live.values():
                self._deltas(live, now)
            self._update_gauges()
            self._metrics.on_iteration(llm.queue_depth().last_step_tokens)
        for output in outputs:
            tracked = self._live.pop(output.request_id, None)
            if tracked is None:
                continue  # aborted meanwhile: its client is gone
            generated = sum(len(o.token_ids) for o in output.outputs)
            self._metrics.on_finish(
                output.finish_reason or "stop",
                len(output.prompt_token_ids),
                output.num_cached_tokens,
                generated,
                output.num_reused_segment_tokens,
            )
            self._ended(tracked, output.finish_reason or "stop")
            if output.error is not None:
                output.error = self._masker.mask(output.error)
            self._deliver(tracked.sink, Done(tracked.index, output))

    def _ended(self, tracked: _Tracked, reason: str) -> None:
        """A request ended (any way): vLLM's per-request series."""
        end = request_end(tracked.seqs, tracked.arrival, time.perf_counter(), reason)
        self._metrics.on_end(end)

    def _deltas(self, tracked: _Tracked, now: float) -> None:
        for seq in tracked.seqs:
            sent = tracked.sent[seq.seq_id]
            new_tokens = seq.output_token_ids[sent:]
            if seq.seq_id in tracked.ended or not (new_tokens or seq.is_finished):
                continue
            stream = tracked.texts[seq.seq_id]
            tracked.sent[seq.seq_id] = sent + len(new_tokens)
            if seq.is_finished:
                text = stream.final_delta(self._llm.output_text(seq))
                tracked.ended.add(seq.seq_id)
            else:
                text = stream.settled_delta(seq)
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = list(seq.output_logprobs[sent : sent + len(new_tokens)])
            reason = seq.finish_reason if seq.is_finished else None
            if new_tokens:
                if not tracked.last_token:  # the request's first token, of any sample
                    self._metrics.on_first_token(now - tracked.arrival, seq.num_prompt_tokens)
                last = tracked.last_token.get(seq.seq_id)
                gap = None if last is None else (now - last) / len(new_tokens)
                self._metrics.on_tokens(len(new_tokens), gap, seq.sample_index)
                tracked.last_token[seq.seq_id] = now
            delta = Delta(tracked.index, seq.sample_index, new_tokens, text, logprobs, reason)
            self._deliver(tracked.sink, delta)

    def _end_all(self, error: str | None) -> None:
        """End every live request: as errors (the engine failed) or aborted (shutting down)."""
        for request_id, tracked in list(self._live.items()):
            output = self._llm.abort_request(request_id)
            del self._live[request_id]
            self._ended(tracked, "error" if error is not None else "abort")
            if output is None:
                continue
            if error is not None:
                output.finish_reason, output.error = "error", self._masker.mask(error)
            self._deliver(tracked.sink, Done(tracked.index, output))
        self._update_gauges()


def _samples(sub: Submission) -> int:
    """The sequences a submission becomes: its n samples."""
    return max(sub.params.n, 1)


def _run_sinks(batch: list[tuple[Sink, Event]]) -> None:
    for sink, event in batch:
        sink(event)
