"""A request's logit rules (allowed_token_ids, min_tokens, logit_bias, bad_words) and
include_stop_str_in_output: greedy output equals transformers' greedy `generate` with the same
rule (`sequence_bias`, `min_new_tokens`, a logits processor keeping the allowed tokens,
`bad_words_ids`), in one batch of mixed rules with the cache on and off and under preemption;
`apply_rules` equals a dense per-row reference; bad rules are refused by name."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_reference import hf_greedy, make_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from kvcache import LLM, SamplingParams
from runner.cli.batch.file import parse_line
from runner.engine.sequence import Sequence
from runner.sampling.logit_rules import apply_rules, bad_word_ids

MAX_NEW = 12
VARIANTS: dict[str, dict[str, Any]] = {
    "cache-on": {},
    "cache-off": {"enable_prefix_caching": False},
    "tiny-pool": {"num_kv_blocks": 40, "block_size": 4},
    "no-cpu-kernels": {"cpu_kernels": False},
}


class KeepOnly(LogitsProcessor):
    """transformers-side reference for allowed_token_ids."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = torch.tensor(allowed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kept = torch.full_like(scores, -torch.inf)
        kept[:, self.allowed] = scores[:, self.allowed]
        return kept


def rule_cases(hf: Any, prompts: list[list[int]]) -> list[tuple[SamplingParams, list[int]]]:
    """Per prompt, params with one rule (cycling through them) and transformers' greedy
    output under the same rule. Each rule is chosen from the prompt's unruled output so that
    it changes that output."""
    vocab = hf.config.vocab_size
    rng = random.Random(3)
    base = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    cases = []
    for i, prompt in enumerate(prompts):
        free = hf_greedy(hf, prompt, MAX_NEW, None)
        kind = i % 4
        if kind == 0:  # the free output's tokens banned, a few others raised
            bias = {t: -100.0 for t in free[:3]} | {rng.randrange(vocab): 0.5 for _ in range(20)}
            params = dataclasses.replace(base, logit_bias=bias)
            sequence_bias = {(t,): b for t, b in bias.items()}
            ref = hf_greedy(hf, prompt, MAX_NEW, None, sequence_bias=sequence_bias)
        elif kind == 1:  # a handful of tokens, not the free output's first
            allowed = rng.sample([t for t in range(vocab) if t != free[0]], 12)
            params = dataclasses.replace(base, allowed_token_ids=allowed)
            processors = LogitsProcessorList([KeepOnly(allowed)])
            ref = hf_greedy(hf, prompt, MAX_NEW, None, logits_processor=processors)
        elif kind == 2:  # the free output's third token would stop it at once
            stop = free[2]
            params = dataclasses.replace(base, stop_token_ids=[stop], min_tokens=7)
            ref = hf_greedy(hf, prompt, MAX_NEW, stop, min_new_tokens=7)
        else:  # no rule, in the same batch
            params, ref = base, free
        assert ref != free or kind == 3, "the rule changes nothing: a weak case"
        cases.append((params, ref))
    return cases


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen3_dir"])
def rules_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[Any]]:
    path: Path = request.getfixturevalue(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size, seed=11)
    return path, prompts, rule_cases(hf, prompts)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rules_equal_transformers_in_one_batch(
    rules_case: tuple[Path, list[list[int]], list[Any]], variant: str
) -> None:
    path, prompts, cases = rules_case
    llm = LLM(str(path), **VARIANTS[variant])
    outs = llm.generate(prompts, [params for params, _ in cases])
    for i, (out, (_, ref)) in enumerate(zip(outs, cases, strict=True)):
        assert out.token_ids == ref, f"prompt {i} ({variant})"
    llm.block_manager.check_integrity()


def test_sampled_tokens_stay_in_the_allowed_set(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    allowed = [7, 19, 23, 100]
    params = SamplingParams(
        max_tokens=40, temperature=1.5, seed=1, ignore_eos=True, allowed_token_ids=allowed
    )
    outs = llm.generate([[5, 6, 7], [9] * 20], [params, dataclasses.replace(params, n=3)])
    tokens = [t for o in outs for sample in o.outputs for t in sample.token_ids]
    assert len(tokens) == 4 * 40 and set(tokens) <= set(allowed)
    assert len(set(tokens)) > 1  # sampled, not one token over and over


def test_stop_strings_under_min_tokens_and_include_stop_str(tiny_llama_tok_dir: Path) -> None:
    """A stop string counts only once it ends past the first min_tokens tokens' text, and
    include_stop_str_in_output keeps it at the end of the text."""
    llm = LLM(str(tiny_llama_tok_dir))
    letters = llm.tokenizer.encode("abc d", add_special_tokens=False)  # one byte token each
    base = SamplingParams(
        max_tokens=40, temperature=1.0, seed=5, ignore_eos=True, allowed_token_ids=letters
    )
    free = llm.generate(["Hello there"], base)[0]
    assert set(free.text) <= set("abc d") and len(free.text) == 40
    stop = free.text[3:5]  # ends within the first few tokens
    first = free.text.find(stop)
    cases = {
        (0, False): free.text[:first],
        (0, True): free.text[: first + len(stop)],
    }
    floor = len(llm.tokenizer.decode(free.token_ids[:20], skip_special_tokens=True))
    later = free.text.find(stop, max(0, floor - len(stop) + 1))
    end = len(free.text) if later < 0 else later
    cases[(20, False)] = free.text[:end]
    cases[(20, True)] = free.text if later < 0 else free.text[: later + len(stop)]
    for (min_tokens, include), expected in cases.items():
        params = dataclasses.replace(
            base, stop=[stop], min_tokens=min_tokens, include_stop_str_in_output=include
        )
        out = llm.generate(["Hello there"], params)[0]
        assert out.text == expected, (min_tokens, include)
        streamed = "".join(d.text for d in llm.stream(["Hello there"], params))
        assert streamed == expected
        assert len(out.token_ids) >= min_tokens


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens (5) must be <= max_tokens (3)"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias key must be a token id, got 'x'"),
        ({"logit_bias": {5: 101}}, "logit_bias[5] must be in [-100, 100]"),
        ({"logit_bias": {5: 1.0, "5": 2.0}}, "logit_bias names token 5 twice"),
        ({"logit_bias": [5]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be a non-empty list"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool"),
    ],
)
def test_bad_rules_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**fields)


def test_rules_naming_tokens_the_model_lacks_are_refused(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    vocab = llm.hf_config.vocab_size
    for fields, message in [
        ({"allowed_token_ids": [3, vocab]}, f"allowed_token_ids names token {vocab}"),
        ({"logit_bias": {vocab + 5: 1.0}}, f"logit_bias names token {vocab + 5}"),
        (
            {"allowed_token_ids": [9], "stop_token_ids": [9], "min_tokens": 2},
            "nothing would be left to sample",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6]], SamplingParams(**fields))
    assert not llm.has_unfinished()


def test_batch_file_lines_take_the_rules() -> None:
    line = json.dumps(
        {
            "prompt": "hi",
            "logit_bias": {"7": -100, "9": 2.5},
            "allowed_token_ids": [7, 9],
            "min_tokens": 2,
            "include_stop_str_in_output": True,
        }
    )
    parsed = parse_line(1, line, {"max_tokens": 8}, is_text_file=False)
    assert parsed.error is None and parsed.params is not None
    assert parsed.params.bias_items == ((7, -100.0), (9, 2.5))
    assert parsed.params.min_tokens == 2 and parsed.params.include_stop_str_in_output
    bad = parse_line(2, json.dumps({"prompt": "hi", "min_tokens": 9}), {"max_tokens": 8}, False)
    assert bad.error == "line 2: min_tokens (9) must be <= max_tokens (8)"


Row = tuple[SamplingParams, list[int], tuple[tuple[int, ...], ...]]  # params, output, bad words


def dense_rules(logits: torch.Tensor, rows: list[Row]) -> Any:
    """One row at a time, token by token, as the definitions read (EOS id 2): a bad word's
    last token is banned when the output followed by it would end with the word."""
    out = logits.clone()
    for row, (p, output, bad_words) in enumerate(rows):
        if p.allowed_token_ids:
            for t in range(out.shape[1]):
                if t not in p.allowed_token_ids:
                    out[row, t] = -torch.inf
        if len(output) < p.min_tokens:
            for t in (p.stop_token_ids or []) + ([] if p.ignore_eos else [2]):
                out[row, t] = -torch.inf
        for t in range(out.shape[1]):
            if any((output + [t])[-len(w) :] == list(w) for w in bad_words):
                out[row, t] = -torch.inf
        for t, b in (p.logit_bias or {}).items():
            out[row, t] += b
    return out


VOCAB = 24


@st.composite
def row_rules(draw: st.DrawFn) -> Row:
    tokens = st.integers(0, VOCAB - 1)
    few = st.integers(0, 3)  # a small alphabet, so outputs end with bad words' heads
    params = SamplingParams(
        max_tokens=10,
        min_tokens=draw(st.integers(0, 5)),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(tokens, max_size=3)) or None,
        allowed_token_ids=draw(st.lists(tokens, min_size=1, max_size=6))
        if draw(st.booleans())
        else None,
        logit_bias=draw(st.dictionaries(tokens, st.floats(-100, 100), max_size=5)) or None,
    )
    output = draw(st.lists(few, max_size=6))
    bad_words = draw(st.lists(st.lists(few, min_size=1, max_size=3).map(tuple), max_size=3))
    return params, output, tuple(bad_words)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(row_rules(), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_apply_rules_equals_a_dense_reference(rows: list[Row], seed: int) -> None:
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
    params, outputs, bad_words = ([r[k] for r in rows] for k in range(3))
    ruled = apply_rules(logits, params, outputs, {2}, bad_words)  # type: ignore[arg-type]
    torch.testing.assert_close(ruled, dense_rules(logits, rows))
    assert torch.equal(
        logits, torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
    )


def test_min_tokens_counts_a_character_split_across_tokens_where_it_ends(
    tiny_llama_tok_dir: Path,
) -> None:
    """'€' is three byte tokens: with min_tokens=1 a stop string '€' completed by the third
    token ends past the first token's text (one half-decoded character), so it counts."""
    llm = LLM(str(tiny_llama_tok_dir))
    euro = llm.tokenizer.encode("€", add_special_tokens=False)
    assert len(euro) == 3
    params = SamplingParams(
        max_tokens=9, stop=["€"], include_stop_str_in_output=True, min_tokens=1, ignore_eos=True
    )
    seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=[5], params=params, root=0)
    emitted = [euro * 3]
    finishing = llm.stopper.record_tokens([seq], emitted, [None], now=0.0)
    assert finishing == [(seq, "stop")] and seq.output_token_ids == euro
    assert llm.stopper.output_text(seq) == "€"


def test_bad_words_equal_transformers_bad_words_ids(default_model_dir: Path) -> None:
    """The first two words of each prompt's free answer are never generated: the answers
    equal transformers' greedy `generate` with the words' token sequences as `bad_words_ids`."""
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    llm = LLM(str(default_model_dir))
    tok = llm.tokenizer
    base = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    prompts = [tok.encode(t) for t in ("The capital of France is", "My favourite colour is")]
    params, refs = [], []
    for prompt in prompts:
        free = hf_greedy(hf, prompt, MAX_NEW, None)
        words = tok.decode(free).split()[:2]
        ids = bad_word_ids(tok, words)
        # transformers reads a word's head across the prompt's end too; we read the output.
        assert prompt[-1] not in {w[0] for w in ids if len(w) > 1}, "pick other prompts"
        params.append(dataclasses.replace(base, bad_words=words))
        ref = hf_greedy(hf, prompt, MAX_NEW, None, bad_words_ids=[list(w) for w in ids])
        assert ref != free, "the words change nothing: a weak case"
        refs.append(ref)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    for out, p in zip(outs, params, strict=True):
        assert not set(out.text.split()) & set(p.bad_words or ()), out.text


def test_bad_words_need_a_tokenizer_and_non_blank_strings(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        LLM(str(tiny_llama_dir)).generate([[5, 6]], SamplingParams(bad_words=["x"]))
    for bad in (["ok", " "], "word", [3]):
        with pytest.raises(ValueError, match="bad_words must be a list of non-blank strings"):
            SamplingParams(bad_words=bad)  # type: ignore[arg-type]
