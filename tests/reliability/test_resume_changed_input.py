"""--resume after the input changed: each record carries its request's hash, and a record whose
id is still there but whose request is not is reported and run again, never attached to another
prompt (issue 24, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cli import main


def prompts(path: Path, firsts: list[int]) -> Path:
    """One line per prompt, without ids: each line's id is its line number."""
    path.write_text(
        "".join(json.dumps({"prompt_token_ids": [f, 7, 8, 9, 10]}) + "\n" for f in firsts)
    )
    return path


def answers(path: Path | list[str]) -> dict[str, list[int]]:
    lines = path if isinstance(path, list) else path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), f"an id written twice: {ids}"
    return {r["id"]: r["token_ids"] for r in records}


def test_a_line_added_at_the_top_reruns_the_shifted_lines(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir)]
    args += ["--max-tokens", "3"]
    prompts(src, [20, 30, 40])
    assert CliRunner().invoke(main, args).exit_code == 0
    prompts(src, [10, 20, 30, 40])  # every old line's id moves down one
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert result.output.count("made from another request") == 3  # lines 1-3; 4 is new
    resumed = answers(out)
    fresh = tmp_path / "fresh.jsonl"
    fresh_args = ["generate", str(src), "-o", str(fresh), "--model", str(tiny_llama_dir)]
    assert CliRunner().invoke(main, [*fresh_args, "--max-tokens", "3"]).exit_code == 0
    assert resumed == answers(fresh)
    again = CliRunner().invoke(main, [*args, "--resume"])  # nothing changed now: all kept
    assert again.exit_code == 0 and "4 skipped" in again.output
    assert "made from another request" not in again.output
    # Other options are another request too: a longer answer is asked for.
    longer = CliRunner().invoke(main, [*args[:-1], "5", "--resume"])
    assert longer.exit_code == 0 and longer.output.count("made from another request") == 4
    assert all(len(tokens) == 5 for tokens in answers(out).values())


def test_of_two_records_of_an_id_the_later_is_kept(tmp_path: Path) -> None:
    """A run killed after a changed line's new record was written, before the old one was
    dropped: the next --resume keeps the new one."""
    from runner.cli.batch.records import recover

    out = tmp_path / "out.jsonl"
    out.write_text(
        '{"id": "1", "token_ids": [1], "request_hash": "00000000000000a1"}\n'
        '{"id": "2", "token_ids": [2], "request_hash": "00000000000000b2"}\n'
        '{"id": "1", "token_ids": [3], "request_hash": "00000000000000a3"}\n'
        '{"id": "2", "error": "failed"}\n'
    )
    recovered = recover(out)
    assert recovered.done == {"1": "00000000000000a3", "2": "00000000000000b2"}
    assert recovered.errors == {b'{"id": "2", "error": "failed"}\n'}  # kept until it runs again
    assert answers(out.read_text().splitlines()[:2]) == {"2": [2], "1": [3]}
