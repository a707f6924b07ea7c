"""What passes between the HTTP handlers and the engine loop: a Submission in, then for each
request an Accepted or a Rejected, its Deltas, and its Done."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runner.engine.requests.outputs import RequestOutput
from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.engine.sequence import Sequence
from runner.sampling.logprobs import TokenLogprobs
from runner.sampling.params import SamplingParams


@dataclass(frozen=True)
class Delta:
    """One sample's new tokens and settled text after a step; `finish_reason` on its last."""

    index: int  # the prompt's position in its HTTP call
    sample_index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None


@dataclass(frozen=True)
class Done:
    """A request ended (every sample): its output, "error" as finish_reason if it failed."""

    index: int
    output: RequestOutput


@dataclass(frozen=True)
class Rejected:
    """A request could not be queued (a bad prompt, too long for the context): a 400."""

    index: int
    message: str


@dataclass(frozen=True)
class Accepted:
    """A request is queued: its Deltas and its Done follow."""

    index: int


Event = Accepted | Delta | Done | Rejected
Sink = Callable[[Event], None]


@dataclass
class Submission:
    """One engine request of an HTTP call: a prompt (text or ids), or messages to render."""

    request_id: str
    index: int
    params: SamplingParams
    prompt: str | list[int] | SegmentedPrompt | None = None
    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, object] | None = None
    tools: list[dict[str, Any]] | None = None  # what the chat template shows the model
    cache_salt: str | None = None
    priority: int = 0  # vLLM's request priority (lower first)
    # Called on the engine's thread with the request's sequences once it is queued, before a
    # step computes any of it (a prefill worker opens its handover there: from a handler it
    # waited for the engine lock, which the first step of this very prompt could hold to the
    # prefill's end). What it raises is logged, and the request runs on.
    on_queued: Callable[[list[Sequence]], None] | None = None
