"""A model folder's generation_config.json names more end-of-sequence ids (a chat model's
end-of-turn token): the engine stops at them as transformers' `generate` does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvcache import LLM, SamplingParams
from runner.model.loader import generation_eos_ids

PROMPT = [5, 9, 33, 70, 12, 8, 101, 64]


def _copy_with_generation_config(source: Path, folder: Path, content: str) -> Path:
    shutil.copytree(source, folder)
    (folder / "generation_config.json").write_text(content, encoding="utf-8")
    return folder


def test_the_engine_stops_at_generation_configs_eos(tiny_llama_dir: Path, tmp_path: Path) -> None:
    free = LLM(str(tiny_llama_dir)).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    end_of_turn = free.token_ids[3]
    assert end_of_turn not in free.token_ids[:3]  # so the answer ends exactly there
    content = json.dumps({"eos_token_id": [2, end_of_turn], "pad_token_id": 0})
    folder = _copy_with_generation_config(tiny_llama_dir, tmp_path / "model", content)
    assert generation_eos_ids(folder) == {2, end_of_turn}
    out = LLM(str(folder)).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    assert (out.token_ids, out.finish_reason) == (free.token_ids[:4], "stop")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():  # transformers reads the same file
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8)
    assert theirs[0, len(PROMPT) :].tolist() == out.token_ids


@pytest.mark.parametrize(
    ("content", "problem"),
    [("{not json", "cannot read"), ('{"eos_token_id": "x"}', "not a token id")],
)
def test_a_bad_generation_config_is_named(tmp_path: Path, content: str, problem: str) -> None:
    (tmp_path / "generation_config.json").write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=problem) as caught:
        generation_eos_ids(tmp_path)
    assert "generation_config.json" in str(caught.value)


def test_no_generation_config_adds_nothing(tmp_path: Path) -> None:
    assert generation_eos_ids(tmp_path) == set()
