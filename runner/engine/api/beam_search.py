"""Beam search over the engine, as transformers' `generate(num_beams=...)` defines it.

Each step asks the engine for one token of every running beam, with the log-probabilities of its
K likeliest next tokens (vLLM's `LLM.beam_search` works the same way). The prefix cache makes
that cheap: a beam's prompt is its parent's plus one token, so its parent's full blocks are
found cached and its parent's partial last block, kept as a tail when the parent finished, is
copied (kvcache/partial_blocks.py): a step computes one token a beam. From the K best continuations
of all beams (K = 2 beams, or more with several EOS ids) the best `beam_width` that do not end
go on; the ones among the best `beam_width` that end (EOS, or the last allowed token) are scored
by their log-probability over their length ** length_penalty and kept if among the best
`beam_width` so far. The search stops once no running beam can beat the worst kept one
(transformers' heuristic for `early_stopping=False`) or at `max_tokens`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from runner.engine.requests.outputs import RequestOutput
from runner.sampling.params import MAX_LOGPROBS, SamplingParams


class TokenDecoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class BeamEngine(Protocol):
    """What the search needs of the engine (runner/engine/api/llm.py's LLM): a Protocol, so that
    the LLM may import this module."""

    eos_ids: Any
    max_model_len: int

    @property
    def stopper(self) -> TokenDecoder: ...

    def generate(self, prompts: Any, sampling_params: Any = None) -> list[RequestOutput]: ...


@dataclass
class BeamSearchParams:
    """`beam_width` beams per prompt, each up to `max_tokens` new tokens; a finished beam's
    score is its log-probability / its length ** `length_penalty` (above 0 favours longer
    answers)."""

    beam_width: int = 4
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int):
            raise ValueError(f"beam_width must be an integer, got {self.beam_width!r}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.length_penalty, int | float) or isinstance(
            self.length_penalty, bool
        ):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if not -10.0 <= self.length_penalty <= 10.0:  # length ** penalty stays a float
            raise ValueError(f"length_penalty must be in [-10, 10], got {self.length_penalty}")


@dataclass
class BeamSequence:
    """One answer: its new tokens (an EOS that ended it included), text, log-probability and
    score (the log-probability over its length ** length_penalty). vLLM's names for its
    BeamSearchSequence are there too: `tokens` (the prompt's and the answer's) and
    `cum_logprob`."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) | "length"
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def tokens(self) -> list[int]:
        """vLLM's: the prompt's tokens, then the answer's."""
        return self.prompt_token_ids + self.token_ids

    @property
    def cum_logprob(self) -> float:
        """vLLM's name for cumulative_logprob."""
        return self.cumulative_logprob


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` answers, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)


@dataclass
class _Search:
    """One prompt's search: running beams (new tokens, log-probability) and finished ones
    (score, new tokens, log-probability), each list kept to beam_width."""

    prompt: list[int]
    running: list[tuple[list[int], float]]
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)
    done: bool = False


def beam_search(
    llm: BeamEngine, prompts: list[list[int]], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Search every prompt (token ids) at once; `llm` is the engine (runner/engine/api/llm.py)."""
    eos = set() if params.ignore_eos else set(llm.eos_ids)
    width = params.beam_width
    k = max(2, 1 + len(eos)) * width  # continuations looked at a step, as transformers does
    if k > MAX_LOGPROBS:
        raise ValueError(
            f"beam_width {width} needs the {k} likeliest tokens a step; at most {MAX_LOGPROBS}"
        )
    for i, prompt in enumerate(prompts):
        if len(prompt) + params.max_tokens > llm.max_model_len:
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens plus max_tokens {params.max_tokens} exceed "
                f"the model's context ({llm.max_model_len})"
            )
    searches = [_Search(list(p), running=[([], 0.0)]) for p in prompts]
    step_params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=k)
    for step in range(params.max_tokens):
        live = [s for s in searches if not s.done]
        if not live:
            break
        beams = [(s, tokens, lp) for s in live for tokens, lp in s.running]
        outs = llm.generate([s.prompt + tokens for s, tokens, _ in beams], step_params)
        for search in live:
            mine = [(t, lp, o) for (s, t, lp), o in zip(beams, outs, strict=True) if s is search]
            _advance(search, mine, k, step + 1 == params.max_tokens, eos, params)
    return [_result(llm, s, eos) for s in searches]


def _advance(
    search: _Search,
    beams: list[tuple[list[int], float, Any]],
    k: int,
    last: bool,
    eos: Collection[int],
    params: BeamSearchParams,
) -> None:
    """One step of one prompt's search, from each running beam's K likeliest tokens."""
    width, length = params.beam_width, len(beams[0][0]) + 1  # new tokens after this step
    ranked = [
        (lp + token_lp, beam, token, tokens + [token])
        for beam, (tokens, lp, out) in enumerate(beams)
        for token, token_lp in out.logprobs[0].top
    ]
    # Best first; an exact tie goes to the lower (beam, token), as an argmax over the beams'
    # scores laid end to end would pick (transformers' topk leaves tie order unspecified).
    ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
    candidates = [(score, tokens) for score, _, _, tokens in ranked[:k]]
    ends = [last or c[1][-1] in eos for c in candidates]
    # Running: the best that do not end (one that ends goes last, as transformers' -1e9 does).
    order = sorted(range(len(candidates)), key=lambda i: (ends[i], -candidates[i][0]))
    search.running = [(candidates[i][1], candidates[i][0]) for i in order[:width]]
    for rank, (lp, tokens) in enumerate(candidates[:width]):
        if ends[rank]:
            search.finished.append((lp / length**params.length_penalty, tokens, lp))
    search.finished = sorted(search.finished, key=lambda f: -f[0])[:width]
    best_running = search.running[0][1] / length**params.length_penalty
    full = len(search.finished) == width
    search.done = last or (full and best_running <= search.finished[-1][0])


def _result(llm: BeamEngine, search: _Search, eos: Collection[int]) -> BeamSearchOutput:
    sequences = [
        BeamSequence(
            token_ids=tokens,
            text=llm.stopper.decode(tokens),
            cumulative_logprob=lp,
            score=score,
            finish_reason="stop" if tokens[-1] in eos else "length",
            prompt_token_ids=search.prompt,
        )
        for score, tokens, lp in search.finished
    ]
    return BeamSearchOutput(search.prompt, sequences)
