"""An error record keeps its line's own id whenever the line parsed far enough to have one
(issue 42): a line `{"id": "b", ...}` whose prompt held a lone surrogate was recorded as
`{"id": "2", ...}`, under its line number, so a reader could not tell which request failed."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cli import main


def test_error_records_keep_the_lines_own_id(tiny_llama_dir: Path, tmp_path: Path) -> None:
    lines = [
        b'{"id": "a", "prompt_token_ids": [5, 6, 7]}',
        b'{"id": "b", "prompt": "x\\ud800"}',  # a lone surrogate (JSON escape) in the prompt
        b'{"id": "c", "prompt": "\xff"}',  # a byte that is not UTF-8, in the prompt
        b'{"id": 42, "prompt": "\\ud800"}',  # an integer id
        b'{"id": "\xff", "prompt": "x"}',  # the id itself is not text: the line number
        b'{"id": "d\\ud800", "prompt": "x"}',  # nor is this one
        b'{"prompt": "\\ud800"}',  # no id at all: the line number
        b'{"id": "e", "prompt": "\\ud800" ',  # not JSON: no id to keep
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir)]
    result = CliRunner().invoke(main, [*args, "--max-tokens", "2"])
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids = {r["line"]: r["id"] for r in records if "error" in r}
    assert ids == {2: "b", 3: "c", 4: "42", 5: "5", 6: "6", 7: "7", 8: "8"}
    errors = {r["line"]: r["error"] for r in records if "error" in r}
    assert "lone surrogate" in errors[2] and "not valid UTF-8" in errors[3]
    assert [r["id"] for r in records if "error" not in r] == ["a"]
