"""Beam search: every prompt's `beam_width` answers, their order and scores equal
transformers' `generate(num_beams=..., num_return_sequences=...)`, token for token, with and
without an EOS that ends beams early, over several length penalties, with the cache on and
off and under preemption; bad requests are refused by name."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvcache import LLM, BeamSearchParams
from runner.engine.api.beam_search import _advance, _Search

MAX_NEW = 10
VARIANTS: dict[str, dict[str, Any]] = {
    "cache-on": {},
    "cache-off": {"enable_prefix_caching": False},
    "tiny-pool": {"num_kv_blocks": 40, "block_size": 4},
    "block-1": {"block_size": 1},  # every token a full block: a step recomputes nothing
}


def hf_beams(hf: Any, prompt: list[int], width: int, eos: int | None, penalty: float) -> Any:
    """transformers' beam search: its answers (cut after EOS) and their scores, best first."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=eos if eos is not None else -1,
        pad_token_id=0,
        early_stopping=False,
        length_penalty=penalty,
        output_scores=True,
        return_dict_in_generate=True,
    )
    answers = []
    for row in out.sequences:
        tokens = row[len(prompt) :].tolist()
        answers.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return answers, [float(s) for s in out.sequences_scores]


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen3_dir"])
def beam_case(request: pytest.FixtureRequest) -> tuple[Path, list[Any]]:
    """Cases (prompt, width, eos, length penalty, transformers' answers and scores). The EOS
    of a case is a token of its EOS-free best answer, so beams end early and are scored."""
    path: Path = request.getfixturevalue(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(2)
    cases = []
    for i in range(6):
        prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(3, 24))]
        width, penalty = rng.choice([2, 3, 4]), [1.0, 0.5, 2.0, -1.0, 1.0, 0.0][i]
        free, _ = hf_beams(hf, prompt, width, None, penalty)
        eos = None if i % 3 == 0 else free[0][rng.randrange(2, 8)]
        cases.append((prompt, width, eos, penalty, *hf_beams(hf, prompt, width, eos, penalty)))
    return path, cases


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_beams_equal_transformers(beam_case: tuple[Path, list[Any]], variant: str) -> None:
    path, cases = beam_case
    llm = LLM(str(path), **VARIANTS[variant])
    for prompt, width, eos, penalty, answers, scores in cases:
        llm.eos_ids = {eos} if eos is not None else set()  # the case's own EOS, as transformers'
        params = BeamSearchParams(
            beam_width=width, max_tokens=MAX_NEW, length_penalty=penalty, ignore_eos=eos is None
        )
        result = llm.beam_search([prompt], params)[0]
        assert [s.token_ids for s in result.sequences] == answers, (prompt, eos, penalty)
        assert [s.score for s in result.sequences] == pytest.approx(scores, abs=1e-3)
        for seq in result.sequences:
            ended = eos is not None and seq.token_ids[-1] == eos
            assert seq.finish_reason == ("stop" if ended else "length")
    llm.block_manager.check_integrity()
    assert llm.block_manager.stats.blocks_in_use == 0


def test_several_prompts_at_once_equal_each_alone(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    prompts = [[5, 6, 7], [9] * 20, [11, 12]]
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    together = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, together, strict=True):
        alone = LLM(str(tiny_llama_dir)).beam_search([prompt], params)[0]
        assert [s.token_ids for s in out.sequences] == [s.token_ids for s in alone.sequences]
        assert out.prompt_token_ids == prompt


def test_text_prompts_and_decoded_answers(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir))
    out = llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=5))[0]
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert seq.text == llm.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
    assert out.sequences[0].score >= out.sequences[1].score


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"beam_width": 0}, "beam_width must be >= 1"),
        ({"beam_width": 2.5}, "beam_width must be an integer"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"length_penalty": "x"}, "length_penalty must be a number"),
        ({"length_penalty": 1100}, "length_penalty must be in"),
    ],
)
def test_bad_params_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**fields)


def test_requests_that_cannot_run_are_refused_by_name(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    with pytest.raises(ValueError, match="needs the 22 likeliest tokens a step"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=11))
    with pytest.raises(ValueError, match="exceed the model's context"):
        llm.beam_search([[5] * 500], BeamSearchParams(max_tokens=20))
    with pytest.raises(ValueError, match="prompt 1: prompt token 0 is 100000"):
        llm.beam_search([[5, 6], [100000]], BeamSearchParams())
    small = LLM(str(tiny_llama_dir), num_kv_blocks=4, block_size=4)  # 16 tokens in all
    with pytest.raises(ValueError, match="prompt 1: .* needs 5 KV blocks"):
        small.beam_search([[3, 4], [5] * 10], BeamSearchParams(beam_width=3, max_tokens=10))
    assert small.scheduler.step_count == 0  # refused before any work
    assert not llm.has_unfinished()


def test_exact_ties_go_to_the_lower_beam_and_token() -> None:
    """Continuations that score exactly alike are ranked by (beam, token), as an argmax over
    the beams' scores laid end to end would pick them."""
    search = _Search(prompt=[1], running=[([7], -1.0), ([8], -1.0)])

    def top(pairs: list[tuple[int, float]]) -> Any:
        return SimpleNamespace(logprobs=[SimpleNamespace(top=pairs)])

    beams = [([7], -1.0, top([(31, -0.5), (30, -0.5)])), ([8], -1.0, top([(9, -0.5)]))]
    _advance(search, beams, k=3, last=False, eos=set(), params=BeamSearchParams(beam_width=2))
    assert search.running == [([7, 30], -1.5), ([7, 31], -1.5)]
