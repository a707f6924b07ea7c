"""Valid JSON that is not text, or too deep to read: a lone surrogate ("\\ud800") in a prompt,
a message, a stop string, a bad word or an id, and a line nested 5,000 levels deep, each fail
their own line in `kvcache generate` (and --resume), and raise ValueError in the API (issue 24,
item 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from kvcache import LLM, SamplingParams
from runner.sampling.structured_outputs import StructuredOutputsParams

SURROGATE = "\\ud800"  # as the JSON escape, written into the file as is


def bad_lines() -> list[str]:
    deep = '{"id": "deep", "prompt": "hi", "logit_bias": ' + "[" * 5000 + "]" * 5000 + "}"
    return [
        f'{{"id": "prompt", "prompt": "a{SURROGATE}b"}}',
        f'{{"id": "message", "messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
        f'{{"id": "stop", "prompt": "hello", "stop": ["{SURROGATE}"]}}',
        f'{{"id": "bad_words", "prompt": "hello", "bad_words": ["x{SURROGATE}"]}}',
        f'{{"id": "x{SURROGATE}", "prompt": "hello"}}',
        "[" * 5000 + "]" * 5000,
        deep,
    ]


def test_each_bad_line_fails_alone(tiny_llama_tok_dir: Path, tmp_path: Path) -> None:
    good = [json.dumps({"id": f"good{i}", "prompt": f"hello {i}"}) for i in range(2)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([good[0], *bad_lines(), good[1]]) + "\n")
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_tok_dir)]
    args += ["--max-tokens", "2"]
    for extra in ([], ["--resume"]):  # --resume reads the same lines again
        result = CliRunner().invoke(main, [*args, *extra])
        crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
        assert result.exit_code == 1 and not crashed, result.output
        records = [json.loads(line) for line in out.read_text().splitlines()]
        errors = {r["line"]: r["error"] for r in records if "error" in r}
        assert sorted(r["id"] for r in records if "error" not in r) == ["good0", "good1"]
        assert sorted(errors) == list(range(2, 9))
        for line_no in range(2, 7):
            assert "lone surrogate U+D800" in errors[line_no], errors[line_no]
        assert "prompt" in errors[2] and "messages[0].content" in errors[3]
        assert "stop[0]" in errors[4] and "bad_words[0]" in errors[5] and "a key" not in errors[6]
        assert "nested too deeply" in errors[7] and "nested too deeply" in errors[8]


def test_the_api_raises_value_error(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir))
    params = SamplingParams(max_tokens=2)
    bad = "a\ud800b"
    with pytest.raises(ValueError, match="prompt is not valid Unicode text"):
        llm.generate(bad, params)
    with pytest.raises(ValueError, match=r"messages\[0\].content is not valid Unicode"):
        llm.chat([{"role": "user", "content": bad}], params)
    with pytest.raises(ValueError, match=r"stop\[0\] is not valid Unicode"):
        SamplingParams(stop=[bad])
    with pytest.raises(ValueError, match=r"bad_words\[0\] is not valid Unicode"):
        SamplingParams(bad_words=[bad])
    deep: dict = {}
    inner = deep
    for _ in range(5000):
        inner["items"] = {}
        inner = inner["items"]
    with pytest.raises(ValueError, match="json schema is nested too deeply"):
        StructuredOutputsParams(json=deep)
    assert llm.generate("hello", params)[0].finish_reason == "length"  # the engine goes on
    llm.block_manager.check_integrity()
