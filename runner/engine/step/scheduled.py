"""What one step computes, as the scheduler hands it to the model runner: each sequence's
positions (`ScheduledSeq`), and the step's admissions and preemptions (`SchedulerOutput`)."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field

from runner.engine.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # True when this chunk ends at the sequence's newest token: its logits pick the next token.
    sample: bool
    # K/V positions [start, start + num_new_tokens) are computed this step. Of a drafted
    # item's, `commit` caches only those whose tokens were output (the newest token and the
    # accepted guesses: StepResult.computed).
    start: int = 0
    # Guessed tokens fed after a decoding sequence's newest one (speculative.py): the
    # step computes 1 + len(draft) positions, and the engine keeps those the model agrees with.
    draft: list[int] = field(default_factory=list)
    # The sequence's block table as the block manager holds it (read only), set once the step
    # is scheduled: the model runner reads its slots from here, never from the manager.
    block_table: abc.Sequence[int] = ()

    @property
    def decodes(self) -> bool:
        return self.sample and (bool(self.draft) or self.num_new_tokens == 1)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.decodes)

    @property
    def num_decode_tokens(self) -> int:
        """Decode positions computed, drafts included."""
        return sum(1 + len(s.draft) for s in self.scheduled if s.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def without(self, gone: list[Sequence]) -> SchedulerOutput:
        """The step as it ran once these sequences failed out of it (for the step's record)."""
        ids = {id(seq) for seq in gone}
        return SchedulerOutput(
            [item for item in self.scheduled if id(item.seq) not in ids],
            [seq for seq in self.admitted if id(seq) not in ids],
            list(self.preempted),
        )
