"""One `kvcache generate` run writes an OUTPUT at a time (issue 42): two runs on one -o both
succeeded, and the file held every record twice. The first run locks the file (flock) before
its model loads and holds it to the end; a second is refused at once, naming the file."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main

REPO = Path(__file__).resolve().parents[2]


def _lines(path: Path, n: int, tokens: int = 30) -> Path:
    rows = [
        json.dumps(
            {"id": f"r{i}", "prompt_token_ids": [3 + (i * 7 + k) % 200 for k in range(tokens)]}
        )
        for i in range(n)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_locked_output_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    src = _lines(tmp_path / "in.jsonl", 1)
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "r0", "text": "kept"}\n')
    with out.open("a") as other_run:  # what a run writing it holds
        fcntl.flock(other_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        args = ["generate", str(src), "-o", str(out), "--resume"]
        result = CliRunner().invoke(main, [*args, "--model", str(tmp_path / "no-such-model")])
    assert result.exit_code == 1, result.output
    assert str(out) in result.output and "another kvcache generate run" in result.output
    assert "no-such-model" not in result.output  # refused before the model was looked for
    assert out.read_text() == '{"id": "r0", "text": "kept"}\n'


def test_two_runs_on_one_output_write_each_record_once(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The first run reads its lines from stdin, so it holds OUTPUT for as long as the test
    keeps stdin open: the second run starts while the first surely runs."""
    n = 20
    src = _lines(tmp_path / "in.jsonl", n)
    out = tmp_path / "out.jsonl"
    tail = ["-o", str(out), "--model", str(tiny_llama_dir), "--max-tokens", "4"]
    cmd = [sys.executable, "-m", "cli", "generate"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        [*cmd, "-", *tail], env=env, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert first.stdin is not None
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not out.exists() and first.poll() is None:
            time.sleep(0.05)
        second = subprocess.run(
            [*cmd, str(src), *tail, "--resume"], env=env, capture_output=True, text=True
        )
        assert second.returncode == 1, second.stderr
        assert f"{out} is being written by another kvcache generate run" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # still holding it
        first.stdin.write(src.read_bytes())
    finally:
        first.stdin.close()
        first.wait(timeout=300)
    assert first.returncode == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))  # each once
    # The lock ends with the run: now --resume finds every id done.
    again = subprocess.run([*cmd, str(src), *tail, "--resume"], env=env, capture_output=True)
    assert again.returncode == 0, again.stderr
    assert out.read_text().count("\n") == n


def test_a_refused_start_leaves_no_empty_output(tmp_path: Path) -> None:
    src = _lines(tmp_path / "in.jsonl", 1)
    out = tmp_path / "new.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", str(tmp_path / "no-such-model")]
    assert CliRunner().invoke(main, args).exit_code == 1
    assert not out.exists()


def test_the_lock_moves_to_the_file_resume_rewrites(tmp_path: Path) -> None:
    """--resume cuts a torn tail by swapping a new file in: that new file is the one held."""
    from runner.cli.batch.file import ResultWriter
    from runner.cli.output_lock import LockedOutput, OutputInUse

    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "x"}\n{"id": "b", "te')  # a torn last line
    before = out.stat().st_ino
    writer = ResultWriter(out, resume=True)
    assert out.stat().st_ino != before and writer.done_ids == {"a"}
    with pytest.raises(OutputInUse, match="another kvcache generate run"):
        LockedOutput(out)
    writer.write({"id": "b", "text": "y"})
    writer.close()
    LockedOutput(out).close()  # free again once the writer is closed
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]
