"""--resume on an input that repeats an id (an explicit "2" beside a second line without an id,
3 beside "3"): the id belongs to its first line that parses, on resume as in a fresh run, so
resuming a finished run runs nothing and leaves OUTPUT byte for byte as it was; and a record
that has no valid request hash never replaces one that has (issue 51, item 1)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cli import main

HASH_A, HASH_B = "0123456789abcdef", "fedcba9876543210"


def run(src: Path, out: Path, model: Path, *extra: str) -> tuple[int, str]:
    args = ["generate", str(src), "-o", str(out), "--model", str(model), "--max-tokens", "3"]
    result = CliRunner().invoke(main, [*args, *extra])
    return result.exit_code, result.output


def write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resuming_a_finished_run_with_repeated_ids_changes_nothing(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    src = write(
        tmp_path / "in.jsonl",
        [
            {"id": "2", "prompt_token_ids": [11, 7, 8]},
            {"prompt_token_ids": [22, 7, 8]},  # its id is its line number: "2" again
            {"id": 3, "prompt_token_ids": [33, 7, 8]},
            {"id": "3", "prompt_token_ids": [44, 7, 8]},  # "3" is 3's id
            {"id": "x", "prompt_token_ids": [55, 7, 8]},
            {"id": "x", "prompt": 5},  # a repeat that does not parse either
        ],
    )
    out = tmp_path / "out.jsonl"
    code, output = run(src, out, tiny_llama_dir)
    assert code == 1 and output.count("error: line") == 3, output
    fresh = out.read_bytes()
    answers = {r["id"]: r["line"] for r in records(out) if "error" not in r}
    errors = sorted(r["line"] for r in records(out) if "error" in r)
    assert answers == {"2": 1, "3": 3, "x": 5} and errors == [2, 4, 6]
    for _ in range(2):  # each resume: nothing runs, nothing changes
        code, output = run(src, out, tiny_llama_dir, "--resume")
        assert code == 1 and "3 requests" not in output, output
        assert "0 requests, 3 errors, 3 skipped" in output, output
        assert "running it again" not in output and "dropped" not in output
        assert out.read_bytes() == fresh


def test_a_failing_line_before_the_good_line_of_its_id_settles(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The id belongs to the later line, which parses: the earlier failing line never drops
    its answer (before, every --resume dropped it and ran the line again)."""
    src = write(
        tmp_path / "in.jsonl",
        [{"id": "a", "prompt": ""}, {"id": "a", "prompt_token_ids": [9, 7, 8]}],
    )
    out = tmp_path / "out.jsonl"
    assert run(src, out, tiny_llama_dir)[0] == 1
    fresh = out.read_bytes()
    code, output = run(src, out, tiny_llama_dir, "--resume")
    assert code == 1 and "0 requests, 1 errors, 1 skipped" in output, output
    assert out.read_bytes() == fresh


def test_an_error_record_goes_once_its_line_runs_and_a_failing_line_drops_its_answer(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    src = write(
        tmp_path / "in.jsonl",
        [{"id": "a", "prompt": ""}, {"id": "b", "prompt_token_ids": [9, 7, 8]}],
    )
    out = tmp_path / "out.jsonl"
    assert run(src, out, tiny_llama_dir)[0] == 1
    write(src, [{"id": "a", "prompt_token_ids": [8, 7, 8]}, {"id": "b", "prompt": ""}])
    code, output = run(src, out, tiny_llama_dir, "--resume")
    assert code == 1 and "id 'b': its record in" in output and "dropped" in output, output
    kept = records(out)
    assert sorted((r["id"], "error" in r) for r in kept) == [("a", False), ("b", True)]


def test_a_record_without_a_valid_hash_never_replaces_a_hashed_one(tmp_path: Path) -> None:
    from runner.cli.batch.records import recover

    out = tmp_path / "out.jsonl"
    hashed = {"id": "1", "token_ids": [1], "request_hash": HASH_A}
    later = [
        {"id": "1", "token_ids": [2]},  # no hash
        {"id": "1", "token_ids": [3], "request_hash": 7},  # not a string
        {"id": "1", "token_ids": [4], "request_hash": "zz"},  # not a hash
        {"id": "2", "token_ids": [5], "request_hash": 7},  # alone: kept, but matches no line
        {"id": "3", "token_ids": [6]},  # alone, without one: written before records had one
    ]
    write(out, [hashed, *later])
    recovered = recover(out)
    assert recovered.done == {"1": HASH_A, "2": "", "3": None}
    assert [r["token_ids"] for r in records(out)] == [[1], [5], [6]]
    write(out, [hashed, {"id": "1", "token_ids": [9], "request_hash": HASH_B}])
    assert recover(out).done == {"1": HASH_B}  # a hashed later record is an answer to a change
    assert [r["token_ids"] for r in records(out)] == [[9]]
