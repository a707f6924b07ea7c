"""Speculative decoding by n-gram lookup: the proposer and acceptance against plain
references; greedy output with drafts equal to transformers' greedy `generate`, token for
token, with the cache on and off, under preemption, in static batches and beside sampled
requests, through sliding windows and soft-capped scores, with stops and max_tokens inside an
accepted run; sampled output with drafts equal to the same requests' output without them,
token for token."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from greedy_reference import hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import LLM, SamplingParams
from runner.engine.step.speculative import NGRAM_MAX, NGRAM_MIN, draftable, propose
from runner.engine.step.tokens import accepted
from tests.conftest import load_hf_reference

MAX_NEW = 24
VARIANTS: dict[str, dict[str, Any]] = {
    "cache-on": {},
    "cache-off": {"enable_prefix_caching": False},
    "tiny-pool": {"num_kv_blocks": 24, "block_size": 4},
    "static": {"batching": "static"},
    "no-cpu-kernels": {"cpu_kernels": False},
}


def naive_propose(tokens: list[int], k: int) -> list[int]:
    """The longest n-gram first; its latest earlier occurrence; what followed it."""
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if len(tokens) <= n:
            continue
        newest = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == newest:
                return tokens[i + n : i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(0, 6))
def test_propose_equals_a_plain_search(tokens: list[int], k: int) -> None:
    assert propose(tokens, k) == naive_propose(tokens, k)


def test_propose_and_accept_examples() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert propose([7, 8, 7, 8], 5) == [7, 8]  # "7 8" last followed position 0
    assert propose([1, 2, 3], 2) == []
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, plus the model's next
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # kept to the first miss, its fix
    assert accepted([5], [4, 1]) == [4]


def test_only_requests_whose_tokens_need_logits_and_their_stream_alone_are_drafted_for() -> None:
    greedy = SamplingParams(temperature=0)
    assert draftable(greedy)
    for sampled in (
        {"temperature": 0.7},
        {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 4},
    ):
        assert draftable(dataclasses.replace(greedy, **sampled)), sampled
    for change in (
        {"repetition_penalty": 1.2},
        {"logprobs": 1},
        {"min_tokens": 1},
        {"logit_bias": {3: 1.0}},
        {"allowed_token_ids": [3, 4]},
    ):
        assert not draftable(dataclasses.replace(greedy, **change)), change


def looping_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (so n-grams recur), and a few that do not."""
    rng = random.Random(5)
    prompts = []
    for period, repeats in ((3, 6), (5, 4), (8, 3), (11, 2)):
        unit = [rng.randrange(3, vocab) for _ in range(period)]
        prompts.append(unit * repeats + unit[: period // 2])
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17)]
    return prompts


# Gemma 2 and 3: the guesses are checked by multi-token queries through sliding windows of 16
# (and Gemma 2's capped scores).
@pytest.fixture(
    scope="module",
    params=["tiny_llama_dir", "tiny_qwen3_dir", "tiny_gemma2_dir", "tiny_gemma3_dir"],
)
def spec_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]]]:
    path: Path = request.getfixturevalue(request.param)
    hf = load_hf_reference(path)
    prompts = looping_prompts(hf.config.vocab_size)
    return path, prompts, [hf_greedy(hf, p, MAX_NEW, None) for p in prompts]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafted_greedy_equals_transformers(
    spec_case: tuple[Path, list[list[int]], list[list[int]]], variant: str
) -> None:
    path, prompts, refs = spec_case
    llm = LLM(str(path), speculative_tokens=4, **VARIANTS[variant])
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    sampled = dataclasses.replace(greedy, temperature=0.9, seed=3)
    outs = llm.generate(prompts + prompts[:2], [greedy] * len(prompts) + [sampled] * 2)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=False)):
        assert out.token_ids == ref, f"prompt {i} ({variant})"
    alone = LLM(str(path)).generate(prompts[:2], sampled)  # never drafted: the same samples
    assert [o.token_ids for o in outs[-2:]] == [o.token_ids for o in alone]
    stats = llm.stats()
    assert (
        stats["num_accepted_tokens"] > 0
        and stats["num_draft_tokens"] >= stats["num_accepted_tokens"]
    )
    llm.block_manager.check_integrity()
    assert llm.block_manager.stats.blocks_in_use == 0


def test_stops_and_max_tokens_inside_an_accepted_run(
    spec_case: tuple[Path, list[list[int]], list[list[int]]],
) -> None:
    """A stop token or max_tokens that falls inside a step's accepted tokens ends the output
    right there, as one token a step would."""
    path, prompts, refs = spec_case
    llm = LLM(str(path), speculative_tokens=6)
    params, expected = [], []
    for i, ref in enumerate(refs):
        base = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        if i % 2:
            params.append(dataclasses.replace(base, max_tokens=7 + i))
            expected.append(ref[: 7 + i])
        else:
            stop = ref[9]
            params.append(dataclasses.replace(base, stop_token_ids=[stop]))
            expected.append(ref[: ref.index(stop) + 1])
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert llm.stats()["num_accepted_tokens"] > 0
    llm.block_manager.check_integrity()


def test_speculative_tokens_is_checked(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="speculative_tokens must be in"):
        LLM(str(tiny_llama_dir), speculative_tokens=-1)


def test_guesses_take_only_what_the_step_leaves(tiny_llama_dir: Path) -> None:
    """A token budget of 6 and three decoding requests: every step still decodes all three
    (guesses get only the budget left over), and the metrics call a step that kept several
    guessed tokens a decode, not a prefill."""
    llm = LLM(str(tiny_llama_dir), speculative_tokens=4, max_num_batched_tokens=6)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    sampled = dataclasses.replace(greedy, temperature=0.9, seed=1)
    outs = llm.generate([[7, 8, 9] * 4, [5, 6], [10, 11]], [greedy, sampled, sampled])
    assert llm.stats()["num_accepted_tokens"] > 0 and llm.scheduler.num_preemptions == 0
    steps = llm.metrics()["steps"]
    decoding = [s["states"] for s in steps if len(s["states"]) == 3]
    assert decoding and all(set(states.values()) == {"decode"} for states in decoding[1:])
    alone = LLM(str(tiny_llama_dir)).generate([[5, 6], [10, 11]], sampled)
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in alone]


def test_a_request_that_repeats_an_earlier_one_drafts_from_the_cache(
    spec_case: tuple[Path, list[list[int]], list[list[int]]],
) -> None:
    """The same prompts a second time: each guesses what the first run went on with (its
    blocks are cached), keeps almost every guess, and still answers as transformers does; a
    request under another cache_salt sees none of it."""
    path, prompts, refs = spec_case
    llm = LLM(str(path), speculative_tokens=4)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    before = llm.stats()
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    after = llm.stats()
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    kept = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    # The first run's last partial block is not cached: past it, n-gram guesses may miss.
    assert kept >= 0.8 * drafted and kept >= len(prompts) * (MAX_NEW // 16) * 8
    salted = llm.generate(prompts, params, cache_salt="elsewhere")
    assert [o.token_ids for o in salted] == refs
    assert llm.stats()["num_accepted_tokens"] - after["num_accepted_tokens"] < kept
    llm.block_manager.check_integrity()


@pytest.mark.parametrize("variant", ["cache-on", "tiny-pool", "static"])
def test_drafted_sampling_equals_sampling_without_drafts(
    tiny_llama_dir: Path, variant: str
) -> None:
    """Each position of a drafted sampling request is drawn with the uniform plain decoding
    would give it: the answers of seeded and engine-seeded requests under several filters are
    the same token for token, and guesses are kept."""
    prompts = looping_prompts(320)
    base = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    kinds = [
        dataclasses.replace(base, temperature=0.3, seed=11),
        dataclasses.replace(base, temperature=0.8, top_k=4, seed=12),
        dataclasses.replace(base, temperature=0.6, top_p=0.8, min_p=0.1),  # engine-seeded
        dataclasses.replace(base, temperature=0),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))] + kinds[:2]
    batch = prompts + prompts[:2]
    spec = LLM(str(tiny_llama_dir), seed=5, speculative_tokens=4, **VARIANTS[variant])
    plain = LLM(str(tiny_llama_dir), seed=5, **VARIANTS[variant])
    outs = spec.generate(batch, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(batch, params)]
    kept_before = spec.stats()["num_accepted_tokens"]
    sampled_only = spec.generate(batch[:3], params[:3])  # no greedy request to keep guesses
    assert [o.token_ids for o in sampled_only] == [o.token_ids for o in outs[:2]] + [
        plain.generate(batch[2:3], params[2:3])[0].token_ids
    ]
    if variant != "tiny-pool":  # where a pool of 24 blocks leaves room for guesses
        assert spec.stats()["num_accepted_tokens"] > kept_before
    spec.block_manager.check_integrity()
