"""`kvcache generate` with lines given as segments: later segments reused after their second
sighting (the record says how many tokens), bad segment lines failing alone under their own
ids, --blend-ratio 1 the plain engine's answers, and --resume keeping segment lines' answers."""

from __future__ import annotations

import json
import random
from pathlib import Path

from click.testing import CliRunner

from cli import main


def lines(tmp_path: Path) -> Path:
    rng = random.Random(5)
    docs = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(3)]
    rows = []
    for i, order in enumerate(([0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1])):
        system = [3 + i, 4 + i, 5, 6, 7]  # another opening each: no line is another's prefix
        question = [rng.randrange(3, 250) for _ in range(6)]
        rows.append({"id": f"q{i}", "segments": [system] + [docs[j] for j in order] + [question]})
    rows.append({"id": "empty", "segments": [[5, 6], []]})
    rows.append({"id": "ratio", "segments": [[5, 6], [7, 8]], "blend_ratio": 2})
    rows.append({"id": "both", "segments": [[5, 6]], "prompt": "hi"})
    rows.append({"id": "lone", "prompt_token_ids": [5, 6], "blend_ratio": 0.5})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(src: Path, out: Path, model: Path, *extra: str) -> dict[str, dict]:
    args = ["generate", str(src), "-o", str(out), "--model", str(model), "--max-tokens", "6"]
    result = CliRunner().invoke(main, [*args, *extra])
    assert result.exit_code == 1, result.output  # the bad lines
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_segment_lines(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = lines(tmp_path)
    got = run(src, tmp_path / "out.jsonl", tiny_llama_dir, "--max-num-seqs", "1")
    assert "reused_segment_tokens" not in got["q0"]  # first sighting
    assert got["q2"]["reused_segment_tokens"] == got["q3"]["reused_segment_tokens"] == 96
    assert got["empty"]["error"] == "line 5: segment 1 is empty"
    assert "blend_ratio must be a number in [0, 1]" in got["ratio"]["error"]
    assert "exactly one of prompt, messages, prompt_token_ids, segments" in got["both"]["error"]
    assert "blend_ratio applies to a line given as segments" in got["lone"]["error"]
    plain = run(src, tmp_path / "plain.jsonl", tiny_llama_dir, "--blend-ratio", "1")
    assert all("reused_segment_tokens" not in r for r in plain.values())
    for request_id in ("q0", "q1"):  # never blended: the same answers
        assert plain[request_id]["token_ids"] == got[request_id]["token_ids"]
    again = CliRunner().invoke(
        main,
        ["generate", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_llama_dir)]
        + ["--max-tokens", "6", "--max-num-seqs", "1", "--resume"],
    )
    assert again.exit_code == 1, again.output
    resumed = {
        r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    }
    assert {k: v["token_ids"] for k, v in resumed.items() if "error" not in v} == {
        k: v["token_ids"] for k, v in got.items() if "error" not in v
    }
