"""The interface between the scheduler and a scheduling rule: `SchedulingPolicy` is the rule,
`SchedulerMachinery` what the scheduler lends it each step (its queues, the block manager, and
the primitives that admit, decode, prefill and draft while keeping the books right)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Protocol

from kvcache import BlockManager
from runner.engine.config import EngineConfig
from runner.engine.sequence import Sequence
from runner.engine.step.admission import Admission
from runner.engine.step.scheduled import SchedulerOutput


class SchedulerMachinery(Protocol):
    """What a policy drives: the scheduler's state (read, and its queues changed in place) and
    its primitives. A policy moves a sequence out of `waiting` only through `admit`, and
    preempts only through `schedule_decode` (which preempts the policy's victims while the pool
    is short)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def bm(self) -> BlockManager: ...

    @property
    def admission(self) -> Admission:
        """The cache-aware admission order (admission.py), for a policy that wants it."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def step_count(self) -> int: ...

    @property
    def waiting(self) -> deque[Sequence]:
        """The queue, oldest first (a preempted sequence goes back to its front)."""
        ...

    @property
    def running(self) -> list[Sequence]:
        """Admission order."""
        ...

    @property
    def held(self) -> list[Sequence]:
        """Finished sequences still holding their blocks (`SchedulingPolicy.holds_finished`)."""
        ...

    def admit(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Allocate a waiting sequence's blocks (its cached prefix matched) and run it; the
        caller has taken it out of `waiting` and checked `bm.can_allocate`."""
        ...

    def schedule_decode(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Schedule one decode position of a running sequence, preempting the policy's victims
        while the pool is short; False when `seq` itself was preempted."""
        ...

    def schedule_prefill_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule a running prefill's next chunk; returns the tokens it takes of `budget`."""
        ...

    def add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Give the step's decodes guessed tokens out of what is left of `budget`."""
        ...


class SchedulingPolicy(Protocol):
    """A scheduling rule. Holds no per-request state of its own: everything it knows is in the
    machinery and on the sequences, so a policy object may be shared."""

    def schedule(self, machinery: SchedulerMachinery, out: SchedulerOutput) -> None:
        """Fill `out` with this step's work (decodes, prefill chunks, admissions) under
        `config.token_budget` and `config.max_num_seqs`."""
        ...

    def victim(self, running: Seq[Sequence]) -> Sequence:
        """Which of the running sequences (admission order, never empty) to preempt when the
        pool has no room for a decode's next token."""
        ...

    def holds_finished(self, reason: str) -> bool:
        """Whether a running sequence that finished for `reason` keeps its blocks (in `held`)
        until no sequence runs, instead of giving them back at once."""
        ...
