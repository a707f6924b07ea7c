"""What the model and the sampler gave one engine step, for the engine to settle.

The scheduler's output says what a step computes and is never changed after; this says what
came of it: the items that ran, the tokens each sampling item emitted (a drafted item's
newest token and the guesses the model agreed with), and the items that failed even when run
alone (runner/engine/step/step_isolation.py), each with its error."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch

from runner.engine.step.scheduler import ScheduledSeq
from runner.engine.step.speculative import step_tokens
from runner.engine.step.step_clock import StepTiming
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
