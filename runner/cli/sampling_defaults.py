"""`kvcache generate`'s sampling options: the defaults every input line's own sampling fields
go over (runner/cli/batch/file.py), by SamplingParams' names."""

from __future__ import annotations

from typing import TypedDict

from runner.sampling.structured_outputs import StructuredOutputsParams


class SamplingDefaults(TypedDict, total=False):
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str] | None
    bad_words: list[str] | None
    min_tokens: int
    structured_outputs: StructuredOutputsParams | None
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    n: int
    logprobs: int | None
    prompt_logprobs: int | None
