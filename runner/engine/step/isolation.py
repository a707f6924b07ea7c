"""One request's failure fails that request only, never the others of its step.

When the model or the sampler raises for a step, the engine cannot tell from the exception
which request caused it (an index past the vocabulary in one request's guessed tokens, a
sampler that chokes on one request's logits). So it runs the step again one request at a time:
each request's computation (its K/V writes, its logits rows, its sampling) depends only on its
own tokens and its cached prefix, so alone it computes what it would have in the batch. A
request whose run raises again is retried once without its guessed tokens (a guess is only a
guess: dropping it changes no output), and fails only if that raises too. The others keep the
tokens their own run gave, and the step goes on for them.

This costs one forward pass per request of the failed step, and only then. A seeded request
whose sampler had already drawn in the failed batch draws again, so its stream may differ from
an undisturbed run; a step that never fails is untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace
from typing import Protocol

import torch

from runner.engine.step.scheduler import ScheduledSeq
from runner.engine.step.settle import StepResult, sample_step
from runner.sampling.logprobs import TokenLogprobs

log = logging.getLogger(__name__)


class _Runner(Protocol):
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor: ...


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def run_each_alone(
    runner: _Runner, scheduled: list[ScheduledSeq], eos_ids: Collection[int], err: Exception
) -> StepResult:
    """Run each of a failed step's items alone (`err`: what the whole step raised)."""
    result = StepResult.nothing()
    if len(scheduled) == 1 and not scheduled[0].draft:  # nothing to tell apart: it is the one
        result.failed.append((scheduled[0], describe(err)))
        return result
    for item in scheduled:
        try:
            emitted, logprobs = _run_alone(runner, item, eos_ids)
        except Exception as first:  # noqa: BLE001 - this request's failure is its own
            if not item.draft:
                result.failed.append((item, describe(first)))
                continue
            item = replace(item, draft=[], num_new_tokens=1)  # the guesses may be what failed
            try:
                emitted, logprobs = _run_alone(runner, item, eos_ids)
            except Exception as second:  # noqa: BLE001
                result.failed.append((item, describe(second)))
                continue
        result.ran.append(item)
        if item.sample:
            result.sampling.append(item)
            result.emitted.append(emitted)
            result.logprobs.append(logprobs)
    if result.failed:
        ids = ", ".join(item.seq.request_id for item, _ in result.failed)
        log.warning("step failed (%s); run alone, these requests failed: %s", describe(err), ids)
    return result


def _run_alone(
    runner: _Runner, item: ScheduledSeq, eos_ids: Collection[int]
) -> tuple[list[int], TokenLogprobs | None]:
    logits = runner.run([item])
    if not item.sample:
        return [], None
    result = sample_step(logits, [item], eos_ids)
    return result.emitted[0], result.logprobs[0]
