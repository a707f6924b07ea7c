"""Beam search in the bench (`kvcache bench --beam-width W`): the engine's `LLM.beam_search`
against transformers' `generate(num_beams=W)` over padded batches (hf-static), every answer
checked against transformers' unbatched beam search. A request's answer is its best beam."""

from __future__ import annotations

import time

from bench.engine_options import EngineOptions
from bench.peers import PeerResult
from bench.workloads import BenchRequest
from runner.engine.api.beam_search import BeamSearchParams
from runner.engine.api.interface import ServingEngine
from runner.engine.api.llm import LLM

# Systems that cannot search beams: continuous batching and prompt lookup take none.
NO_BEAMS = ("hf-cb", "hf-lookup")


def hf_beam_options(width: int | None) -> dict[str, object]:
    """transformers' generate options for beam search of `width` (none without)."""
    return {"num_beams": width, "early_stopping": False} if width else {}


def run_engine_beams(
    model: str | None,
    requests: list[BenchRequest],
    device: str,
    options: EngineOptions,
    width: int,
) -> PeerResult:
    """Every request searched at once (those alike in max_tokens and ignore_eos together);
    the prefill column counts what the beams' steps computed again (each beam's last partial
    block)."""
    llm: ServingEngine = LLM(model, device=device, **options)
    llm.beam_search([[1, 2, 3, 4, 5]], BeamSearchParams(beam_width=width, max_tokens=2))
    first_step = len(llm.recorded_steps())
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, req in enumerate(requests):
        groups.setdefault((req.max_tokens, req.ignore_eos), []).append(i)
    answers: dict[int, list[int]] = {}
    start = time.perf_counter()
    for (max_tokens, ignore_eos), indices in groups.items():
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
        prompts = [requests[i].prompt_token_ids for i in indices]
        for i, out in zip(indices, llm.beam_search(prompts, params), strict=True):
            answers[i] = out.sequences[0].token_ids
    wall = time.perf_counter() - start
    prefill = sum(s.num_prefill_tokens for s in llm.recorded_steps(first_step))
    return PeerResult([answers[i] for i in range(len(requests))], wall, prefill, [])
