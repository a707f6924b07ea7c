"""A text far past the context is refused by its bytes before it is tokenized, in Python and in
`kvcache generate` as on the server (issue 51, item 10): the error names the bound, the rest
goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from kvcache import LLM, SamplingParams

HUGE = "word " * 1_000_000  # 5 MB


def test_llm_refuses_a_huge_text_before_tokenizing(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir), max_model_len=256)
    params = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="refused before tokenizing"):
        llm.generate(HUGE, params)
    with pytest.raises(ValueError, match="refused before tokenizing"):
        llm.generate({"segments": ["a", HUGE]}, params)
    assert llm.generate("short", params)[0].finish_reason == "length"


def test_generate_refuses_a_huge_line_alone(tiny_llama_tok_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    lines = [{"id": "huge", "prompt": HUGE}, {"id": "ok", "prompt": "hello"}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_tok_dir)]
    result = CliRunner().invoke(main, [*args, "--max-model-len", "256", "--max-tokens", "2"])
    assert result.exit_code == 1, result.output
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "refused before tokenizing" in records["huge"]["error"]
    assert records["ok"]["output_tokens"] == 2
