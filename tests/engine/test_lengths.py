"""How long a prompt and an answer may be (vLLM's names): `truncate_prompt_tokens` keeps a
prompt's last k tokens; `max_tokens=None` answers until prompt and answer fill the context."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from runner.cli.batch.file import parse_line

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_only_the_last_tokens_are_prompted(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    prompt = [3 + (i * 13) % 300 for i in range(50)]
    cut = llm.generate([prompt], dataclasses.replace(GREEDY, truncate_prompt_tokens=20))
    alone = llm.generate([prompt[-20:]], GREEDY)[0]
    assert cut[0].prompt_token_ids == prompt[-20:]
    assert cut[0].token_ids == alone.token_ids
    whole = dataclasses.replace(GREEDY, truncate_prompt_tokens=500)
    assert llm.generate([prompt], whole)[0].prompt_token_ids == prompt


def test_a_prompt_past_the_context_runs_once_cut(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    prompt = [3 + (i * 7) % 300 for i in range(llm.max_model_len + 100)]
    with pytest.raises(ValueError, match="the model's context holds"):
        llm.generate([prompt], GREEDY)
    params = dataclasses.replace(GREEDY, truncate_prompt_tokens=64)
    out = llm.generate([prompt], params)[0]
    assert len(out.prompt_token_ids) == 64 and len(out.token_ids) == 6


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_lengths_are_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)  # type: ignore[arg-type]
    line = json.dumps({"prompt": "hi", "truncate_prompt_tokens": bad})
    assert "truncate_prompt_tokens" in (parse_line(1, line, {}, is_text_file=False).error or "")


def test_max_tokens_none_fills_the_context(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    prompt = [3 + (i * 11) % 300 for i in range(30)]
    params = dataclasses.replace(GREEDY, max_tokens=None, n=2)
    out = llm.generate([prompt], params)[0]
    for sample in out.outputs:
        assert len(sample.token_ids) == llm.max_model_len - len(prompt)
        assert sample.finish_reason == "length"
    assert params.max_tokens is None  # the caller's params are left as they were
    with pytest.raises(ValueError, match="min_tokens"):  # the room left is what min_tokens meets
        llm.generate([prompt], dataclasses.replace(params, min_tokens=llm.max_model_len))
