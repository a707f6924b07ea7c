"""Asynchronous scheduling: the host schedules and prepares step N+1 while the device runs
step N (vLLM's `--async-scheduling`, SGLang's overlap scheduler).

The plain loop (core.py) is schedule -> run -> settle, one step at a time, so on a GPU the
device idles while the host's Python schedules, builds inputs and settles results. Here one
step is in flight at a time. A call to `OverlappedLoop.step`:

1. schedules step N+1 while step N still runs. Each sequence that sampled in step N holds the
   place of that token (`Sequence.hold_pending_token`): the scheduler sees it as if the token
   were known (a decode of one position, a block grown for it), though its value is not;
2. prepares step N+1's inputs on the host and queues its device work: first the held tokens'
   inputs copied from step N's sampled ids, which never left the device, then the forward
   pass and the sampler, whose ids come back to the host by a non-blocking copy;
3. only then waits for step N's ids and settles step N as the plain loop does (tokens
   recorded, stops checked, requests finished, outputs handed over);
4. advances step N+1's sequences (computed positions, filled blocks cached, places held).

A stop is thus found one step late: a sequence that step N ends was also in step N+1, whose
token for it is dropped (a finished sequence takes nothing more; its K/V writes land in blocks
freed after they were queued, and the device runs its work in order). The dropped position is
not the request's: step N+1's record (its decode tokens, its states, the scheduler's iteration
tokens) leaves out every sequence that had finished before it settled.

A step's time is its share of the wall clock: from the later of its launch and the previous
step's settling to its own settling. Steps in flight one behind the other thus tile the time
(their recorded durations add up to the loop's wall time), where timing each from its launch
would count the period in which the previous step settled twice.

A step whose sampling needs the previous token on the host (a grammar's mask, penalties, logit
rules, log-probabilities, prompt log-probabilities, speculative drafts) settles step N first
and runs synchronously, as does a step whose launch raised (it then runs as the plain loop
does, where one request's failure fails it alone). The engine uses this loop on CUDA by default
(`async_scheduling`), never with speculative decoding (its drafts are made from the tokens at
scheduling time).

The device is a `StepDevice`: on CUDA, work is queued on the current stream and read back by an
event; on the CPU it runs at once (the loop then only reorders the bookkeeping). Tests give it
a device that runs each step on a worker thread, to show the overlap without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runner.engine.step.guards import interrupts_held
from runner.engine.step.model_runner import ModelRunner, index_on
from runner.engine.step.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from runner.engine.step.settle import StepResult
from runner.sampling.sampler import sample_on_device

log = logging.getLogger(__name__)


class PendingTokens(Protocol):
    """The ids a queued step samples, one per sampling item, in batch order."""

    def on_device(self) -> torch.Tensor:
        """The ids [N] int64 on the device; called only from the next step's device work."""
        ...

    def wait(self) -> list[int]:
        """Block until the ids are on the host; they (or the step's error) are returned."""
        ...


class StepDevice(Protocol):
    """Where a step's device work runs, in the order it is submitted."""

    def submit(self, work: Callable[[], torch.Tensor]) -> PendingTokens:
        """Queue `work` (forward pass and sampler; returns the sampled ids on the device)."""
        ...

    def run_ordered(self, op: Callable[[], None]) -> None:
        """Run a K/V operation the host issues (a slot copy) after the work queued so far."""
        ...


class _Ready:
    """Ids already computed (the CPU runs a step's work when it is submitted)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def on_device(self) -> torch.Tensor:
        return self.tokens

    def wait(self) -> list[int]:
        return [int(t) for t in self.tokens.tolist()]


class InlineDevice:
    """The CPU: each step's work runs when submitted, so nothing overlaps; the loop still
    settles a step one call late, which is what the CPU tests of this loop check."""

    def submit(self, work: Callable[[], torch.Tensor]) -> PendingTokens:
        return _Ready(work())

    def run_ordered(self, op: Callable[[], None]) -> None:
        op()


class _CopiedBack:
    """Ids being copied to pinned host memory behind the step's kernels."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens
        self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self.host.copy_(tokens, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def on_device(self) -> torch.Tensor:
        return self.tokens

    def wait(self) -> list[int]:
        self.done.synchronize()  # the one point the host waits for the device
        return [int(t) for t in self.host.tolist()]


class CudaDevice:
    """CUDA: a step's kernels are queued on the current stream (and slot copies after them),
    so the host goes on at once; its ids come back by a non-blocking copy and an event."""

    def submit(self, work: Callable[[], torch.Tensor]) -> PendingTokens:
        return _CopiedBack(work())

    def run_ordered(self, op: Callable[[], None]) -> None:
        op()  # queued on the same stream as the steps: ordered behind them


def default_device(device: torch.device) -> StepDevice:
    return CudaDevice() if device.type == "cuda" else InlineDevice()


@dataclass
class InFlight:
    """A step queued on the device and not settled yet."""

    out: SchedulerOutput
    pending: PendingTokens
    sampling: list[ScheduledSeq]  # its items that sample, in the order of its ids
    step: int  # the scheduler's step number
    t_start: float
    rows: dict[int, int] = field(default_factory=dict)  # id(seq) -> its row of the ids


# How the loop settles a step (settle.py's StepSettler) and runs one synchronously (core.py).
Settle = Callable[[SchedulerOutput, StepResult, float, int, bool], None]
RunNow = Callable[[SchedulerOutput], StepResult]
Fail = Callable[[SchedulerOutput, Exception], None]


def overlappable(out: SchedulerOutput) -> bool:
    """Whether a step can be queued before the previous one's tokens are on the host: its
    samplers take the model's logits as they are (no grammar, rule, penalty or
    log-probabilities, which read earlier tokens on the host), no drafts, no prompt
    log-probabilities (written into the sequence by the forward pass)."""
    for item in out.scheduled:
        seq = item.seq
        if item.draft or seq.prompt_logprobs is not None:
            return False
        if item.sample and not seq.plain_logits:
            return False
    return True


@dataclass(eq=False)
class OverlappedLoop:
    """The engine's step with one step in flight (see the module's docstring)."""

    scheduler: Scheduler
    runner: ModelRunner
    device: StepDevice
    settle_step: Settle
    run_now: RunNow
    fail: Fail
    inflight: InFlight | None = field(init=False, default=None)
    # When the last step settled (its share of the wall clock ended): the next step's time
    # starts there if it was launched before (see the module's docstring).
    settled_at: float = field(init=False, default=0.0)
    synchronous_steps: int = field(init=False, default=0)  # steps that could not overlap

    def step(self) -> None:
        """One engine step. A KeyboardInterrupt leaves the loop as the plain loop's does: the
        step in flight stays in flight (its tokens are read by a later call), and a step
        scheduled but not yet advanced is as if never run (the next call schedules again)."""
        t_start = time.perf_counter()
        with interrupts_held():
            out = self.scheduler.schedule()
        step = self.scheduler.step_count
        prev = self.inflight
        if out.is_empty:
            self.settle_inflight()
            return
        pending = None
        if overlappable(out):
            try:
                pending = self._launch(out, prev)
            except Exception as err:  # noqa: BLE001 - the plain step below isolates it
                log.warning(
                    "overlapped step failed to launch (%s: %s): run synchronously",
                    type(err).__name__,
                    err,
                )
                pending = None
        if pending is None:
            self._run_synchronously(out, t_start, step)
            return
        self.settle_inflight()  # the host waits for step N while the device runs step N+1
        self._live_part(out)
        with interrupts_held():
            self.inflight = self._advance(out, pending, step, t_start)
        if all(item.seq.is_finished for item in out.scheduled):
            # Step N finished every sequence of step N+1: nothing will come of it, and an
            # engine left idle holds no step in flight (whose settling would be recorded late).
            self.settle_inflight()

    def settle_inflight(self) -> None:
        """Read the step in flight's ids, if one is, and settle it: each of its sequences
        still running records its token (the place it held takes the value); a finished one's
        is dropped."""
        flight = self.inflight
        if flight is None:
            return
        try:
            tokens = flight.pending.wait()
        except Exception as err:  # noqa: BLE001 - the device failed the step: its requests
            with interrupts_held():
                self.inflight = None
                self.fail(flight.out, err)
                # What it and the step after it cached may hold K/V it never wrote.
                self.scheduler.drop_cached()
            return
        with interrupts_held():
            self.inflight = None
            live = [item for item in flight.sampling if not item.seq.is_finished]
            emitted = [[tokens[flight.rows[id(item.seq)]]] for item in live]
            ran = [item for item in flight.out.scheduled if not item.seq.is_finished]
            result = StepResult(ran, live, emitted, [None] * len(live), [])
            # Recorded as it ran for its live sequences: a finished one's dropped position is
            # neither a decode token nor a step of its request.
            gone = [item.seq for item in flight.out.scheduled if item.seq.is_finished]
            out = flight.out.without(gone) if gone else flight.out
            try:
                start = self._share_start(flight.t_start)
                self.settle_step(out, result, start, flight.step, False)
            except Exception as err:  # noqa: BLE001 - as a failed forward pass: the step's end
                self.fail(flight.out, err)
            self.settled_at = time.perf_counter()

    def _live_part(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step without the sequences the step before it ended (their positions in it are
        dropped, not computed), and the scheduler's iteration tokens counted the same way."""
        gone = [item.seq for item in out.scheduled if item.seq.is_finished]
        if not gone:
            return out
        kept = out.without(gone)
        self.scheduler.last_step_tokens = kept.num_prefill_tokens + kept.num_decode_tokens
        return kept

    def _share_start(self, t_start: float) -> float:
        """Where a step's share of the wall clock starts: at its launch, or where the step
        before it settled if that was later (it was launched while that one ran)."""
        return max(t_start, self.settled_at)

    def _run_synchronously(self, out: SchedulerOutput, t_start: float, step: int) -> None:
        """The plain loop's step, once the step before it is settled (which may finish some of
        this step's sequences: they leave the batch)."""
        self.synchronous_steps += 1
        if self.inflight is not None:
            self.settle_inflight()
            out = self._live_part(out)
            if out.is_empty:
                return
        result = self.run_now(out)
        with interrupts_held():
            try:
                self.settle_step(out, result, self._share_start(t_start), step, True)
            except Exception as err:  # noqa: BLE001 - as a failed forward pass: the step's end
                self.fail(out, err)
            self.settled_at = time.perf_counter()

    def _launch(self, out: SchedulerOutput, prev: InFlight | None) -> PendingTokens:
        """Prepare the step's inputs on the host and queue its device work."""
        batch = out.scheduled
        inputs = self.runner.prepare(batch)
        input_ids = inputs.input_ids
        dst, src = _held_inputs(batch, inputs.meta.query_lens, prev)
        sampling = [item for item in batch if item.sample]
        params = [item.seq.params for item in sampling]
        generators = [item.seq.generator for item in sampling]
        device = input_ids.device
        fill = (index_on(dst, device), index_on(src, device)) if dst and prev is not None else None
        previous = prev.pending if prev is not None else None

        def work() -> torch.Tensor:
            if fill is not None and previous is not None:  # held places: step N's own ids
                input_ids[fill[0]] = previous.on_device().index_select(0, fill[1])
            logits = self.runner.forward(batch, inputs)
            return sample_on_device(logits, params, generators)

        return self.device.submit(work)

    def _advance(
        self, out: SchedulerOutput, pending: PendingTokens, step: int, t_start: float
    ) -> InFlight:
        """Move the queued step's sequences on as if it had finished: their computed positions
        and filled blocks (all tokens known: the previous step is settled), and a held place
        for each one that samples. A sequence the previous step finished takes no part."""
        live = [item for item in out.scheduled if not item.seq.is_finished]
        self.scheduler.commit([(item, item.num_new_tokens) for item in live])
        sampling = [item for item in out.scheduled if item.sample]
        flight = InFlight(out, pending, sampling, step, t_start)
        for row, item in enumerate(sampling):
            flight.rows[id(item.seq)] = row
            if not item.seq.is_finished:
                item.seq.hold_pending_token()
        return flight


def _held_inputs(
    batch: list[ScheduledSeq], query_lens: list[int], prev: InFlight | None
) -> tuple[list[int], list[int]]:
    """(input index, row of the previous step's ids) of each held place among the batch's
    inputs: a decode's one token, or the last of a re-admitted sequence's prefill."""
    dst: list[int] = []
    src: list[int] = []
    offset = 0
    for item, query_len in zip(batch, query_lens, strict=True):
        seq = item.seq
        if seq.pending_token:
            held = seq.num_tokens - 1
            if item.start <= held < item.start + query_len:
                assert prev is not None, "a held token belongs to the step in flight"
                dst.append(offset + held - item.start)
                src.append(prev.rows[id(seq)])
        offset += query_len
    return dst, src
