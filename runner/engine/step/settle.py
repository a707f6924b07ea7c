"""Settling an engine step: what came of it, and what it changes, in the order it happens.
A step's finishing path reads top to bottom here:

1. `sample_step`: the step's logits become each sampling item's new tokens (`step_tokens`,
   runner/engine/step/tokens.py: the plain next token by `next_tokens`, or a drafted
   item's accepted guesses plus the model's own token), as a `StepResult`.
2. `StepSettler.settle`: the items that failed even when run alone (isolation.py) end as
   errors; the others' tokens are recorded and the requests they end found
   (`StopChecker.record_tokens`, runner/engine/requests/stopping.py, appending each token to its
   `Sequence`); drafted and accepted counts are kept; the blocks the step filled are cached
   (`Scheduler.commit` of `StepResult.computed`); the ended requests finish; the step's
   metrics row is written.
3. `StepSettler.finish`: the one place a sequence ends, whatever ends it (a stop, its length,
   an abort, an error): out of the scheduler (its blocks freed), its `RequestOutput` made,
   the request forgotten (runner/engine/requests/request_table.py), the output kept for its caller.

The plain loop (core.py) settles a step as soon as it ran; the overlapped loop (overlap.py)
settles step N while the device runs step N + 1, through the same `settle`.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

import torch

from runner.engine.requests.outputs import RequestOutput, TokenTexts
from runner.engine.requests.request_table import LiveRequests, OutputRouter
from runner.engine.requests.stopping import StopChecker
from runner.engine.sequence import Sequence
from runner.engine.step.metrics import MetricsRecorder, StepTiming
from runner.engine.step.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from runner.engine.step.speculative import SpecStats
from runner.engine.step.tokens import step_tokens
from runner.sampling.logprobs import TokenLogprobs


class StepResult(NamedTuple):
    ran: list[ScheduledSeq]  # in batch order; a retried item without its guesses is a copy
    sampling: list[ScheduledSeq]  # those of `ran` that sample
    emitted: list[list[int]]  # per sampling item
    logprobs: list[TokenLogprobs | None]  # per sampling item
    failed: list[tuple[ScheduledSeq, str]]  # (item, error) of those that failed alone
    timing: StepTiming | None = None  # where the forward's time went (CPU only)

    @staticmethod
    def nothing() -> StepResult:
        return StepResult([], [], [], [], [])

    def computed(self) -> list[tuple[ScheduledSeq, int]]:
        """Each item that ran with the positions its step keeps: all it computed, but for a
        drafted item only its newest token and the accepted guesses (the rest were wrong)."""
        kept = {
            id(item): len(tokens) for item, tokens in zip(self.sampling, self.emitted, strict=True)
        }
        return [(item, kept[id(item)] if item.draft else item.num_new_tokens) for item in self.ran]


def sample_step(
    logits: torch.Tensor,
    batch: list[ScheduledSeq],
    eos_ids: Collection[int],
    timing: StepTiming | None = None,
) -> StepResult:
    """Sample the rows of one forward pass over `batch` (runner/engine/step/speculative.py checks a
    drafted item's guesses against its rows)."""
    sampling = [item for item in batch if item.sample]
    seqs, drafts = [item.seq for item in sampling], [item.draft for item in sampling]
    emitted, logprobs = step_tokens(logits, seqs, drafts, eos_ids)
    return StepResult(list(batch), sampling, emitted, logprobs, [], timing)


@dataclass(eq=False)
class StepSettler:
    """Ends a step's requests and books its tokens; holds nothing of its own (the engine's
    scheduler, stop checker, recorder, request table and output router are handed in)."""

    scheduler: Scheduler
    stopper: StopChecker
    recorder: MetricsRecorder
    spec_stats: SpecStats
    requests: LiveRequests
    outputs: OutputRouter
    token_texts: TokenTexts

    def settle(
        self,
        out: SchedulerOutput,
        result: StepResult,
        t_start: float,
        step: int,
        commit: bool = True,
    ) -> None:
        """After the model ran: fail the requests that failed alone, record the others' new
        tokens (a drafted sequence's one at a time, up to the first that ends it), cache the
        blocks they filled (unless `commit` is False: an overlapped step's were cached when it
        was queued), finish the requests they end (each output to the router as its request is
        forgotten), and record the step as step number `step`."""
        for item, error in result.failed:
            self.outputs.keep(self.finish(item.seq, "error", error))
        now = time.perf_counter()
        seqs = [item.seq for item in result.sampling]
        finishing = self.stopper.record_tokens(seqs, result.emitted, result.logprobs, now)
        for item, tokens in zip(result.sampling, result.emitted, strict=True):
            if item.draft:  # computed and kept: the newest token, then the accepted guesses
                self.spec_stats.update(drafted=len(item.draft), accepted=len(tokens) - 1)
        if commit:
            self.scheduler.commit(result.computed())
        done = [seq for seq, _ in finishing]
        for seq, reason in finishing:
            self.outputs.keep(self.finish(seq, reason, now=now, record=False))
        ran = out if not result.failed else out.without([item.seq for item, _ in result.failed])
        self.recorder.on_step(
            step,
            ran,
            self.scheduler.held,
            t_start,
            time.perf_counter() - t_start,
            self.scheduler.bm.stats,
            result.timing,
        )
        for seq in done:  # after on_step, which still shows them in this step's states
            self.recorder.on_finish(seq)

    def finish(
        self,
        seq: Sequence,
        reason: str,
        error: str | None = None,
        now: float | None = None,
        record: bool = True,
    ) -> RequestOutput | None:
        """The one place a sequence ends, whatever ends it (a stop, its length, an abort, an
        error): out of the scheduler (its blocks freed or, in a static batch, held), its output
        made, the request forgotten. Returns the request's output once its last sample ends;
        `record`: report its finish now (a step's own finishes are reported after the step)."""
        seq.finish_time = now if now is not None else time.perf_counter()
        self.scheduler.finish(seq, reason)
        text, row = self.stopper.output_text(seq), self.recorder.request_record(seq)
        output = RequestOutput.of(seq, text, row, self.token_texts)
        output.error = error
        if record:
            self.recorder.on_finish(seq)  # its report row says why, like its output
        return self.requests.finish(seq, output)

    def fail_unfinished(self, out: SchedulerOutput, err: Exception) -> None:
        """The step's bookkeeping raised: end its requests that are not finished yet as errors
        (freeing their blocks: nothing they computed in the step is cached), so the rest of
        the queue goes on."""
        self.recorder.note_preempted(out.preempted)  # they wait, and show as preempted
        error = f"{type(err).__name__}: {err}"
        for item in out.scheduled:
            if not item.seq.is_finished:  # one that `settle` finished has its output already
                self.outputs.keep(self.finish(item.seq, "error", error))
