"""`kvcache generate --beam-width W`: each good line's W best answers by beam search, written a
chunk of lines at a time (an interrupted run keeps what it wrote, and --resume goes on)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

from runner.cli.batch.file import BatchLine
from runner.engine.api.beam_search import BeamSearchOutput, BeamSearchParams
from runner.engine.api.interface import ServingEngine
from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.engine.requests.validation import Prompt, prompt_token_ids
from runner.sampling.params import SamplingParams

BEAM_CHUNK = 16  # lines searched together: their beams share the engine's steps


class Beam(TypedDict):
    """One answer of a line's beam search, as its record holds it."""

    text: str
    token_ids: list[int]
    finish_reason: str
    cumulative_logprob: float
    score: float


class BeamRecord(Beam):
    """A line's record: its best answer's fields flat, every answer under "beams"."""

    id: str
    line: int
    prompt_tokens: int
    beams: list[Beam]


def line_prompt(llm: ServingEngine, line: BatchLine) -> tuple[Prompt | SegmentedPrompt, bool]:
    """A line's prompt (a conversation through the chat template) and whether its tokenizing
    adds special tokens (not to chat text: the template has put them in)."""
    if line.segments is not None:
        return line.segments, True
    if line.messages is not None:
        return llm.apply_chat_template(line.messages, line.template_kwargs), False
    return line.prompt if line.prompt is not None else list(line.prompt_token_ids or []), True


def search_lines(
    llm: ServingEngine,
    lines: list[BatchLine],
    width: int,
    done: Callable[[BatchLine, BeamRecord], None],
    fail: Callable[[BatchLine], None],
) -> None:
    """Search every line (its max_tokens and ignore_eos; other sampling fields do not apply to
    beam search), grouping lines alike in those; `done` gets each line's record, `fail` each
    line whose prompt cannot run (its error set)."""
    groups: dict[tuple[int, bool], list[tuple[BatchLine, list[int]]]] = {}
    for line in lines:
        params = line.params or SamplingParams()
        try:
            prompt, special = line_prompt(llm, line)
            if isinstance(prompt, SegmentedPrompt):  # beams search its tokens as one prompt
                ids = prompt.token_ids(llm.tokenizer, special)[0]
            else:
                ids = prompt_token_ids(prompt, llm.tokenizer, special)
            llm.check_request(ids, SamplingParams(max_tokens=params.max_tokens))
        except ValueError as err:
            line.error = f"line {line.line_no}: {err}"
            fail(line)
            continue
        max_tokens = llm.room_for(ids, params.max_tokens)
        groups.setdefault((max_tokens, params.ignore_eos), []).append((line, ids))
    for (max_tokens, ignore_eos), group in groups.items():
        beams = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
        for first in range(0, len(group), BEAM_CHUNK):
            chunk = group[first : first + BEAM_CHUNK]
            outs = llm.beam_search([ids for _, ids in chunk], beams)
            for (line, _), out in zip(chunk, outs, strict=True):
                done(line, beam_record(line, out))


def beam_record(line: BatchLine, out: BeamSearchOutput) -> BeamRecord:
    """The line's record: its best answer's fields flat, every answer under "beams"."""
    beams: list[Beam] = [
        {
            "text": seq.text,
            "token_ids": seq.token_ids,
            "finish_reason": seq.finish_reason,
            "cumulative_logprob": seq.cumulative_logprob,
            "score": seq.score,
        }
        for seq in out.sequences
    ]
    return {
        "id": line.request_id,
        "line": line.line_no,
        "prompt_tokens": len(out.prompt_token_ids),
        **beams[0],
        "beams": beams,
    }
