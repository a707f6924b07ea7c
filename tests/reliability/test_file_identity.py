"""`kvcache generate`'s files are compared by identity, and --prefix-cache replaces only a file
it read as this engine's prefix cache (issue 24, items 2 and 3).

Refusals come before the model loads: the tests that expect one pass a model path that does not
exist, which a run that got as far as loading would report instead."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from cli import main

NO_MODEL = "/nonexistent/model"


def lines(path: Path, n: int = 2) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7, 8]}) + "\n"
            for i in range(n)
        )
    )
    return path


def generate(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["generate", *args])
    return result.exit_code, result.output


def test_prefix_cache_naming_another_file_of_the_run_is_refused(tmp_path: Path) -> None:
    src = lines(tmp_path / "in.jsonl")
    before = src.read_bytes()
    out, metrics, fifo = tmp_path / "out.jsonl", tmp_path / "m.json", tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = [
        (["--prefix-cache", str(src)], "is the input file"),
        (["-o", str(out), "--prefix-cache", str(out)], "-o OUTPUT and --prefix-cache"),
        (["--metrics", str(metrics), "--prefix-cache", str(metrics)], "--metrics and --prefix"),
        (["--prefix-cache", str(fifo)], "not a regular file"),
        (["--prefix-cache", str(tmp_path / "no" / "c.st")], "does not exist"),
    ]
    for extra, message in cases:
        code, output = generate(str(src), "--model", NO_MODEL, *extra)
        assert code == 2 and message in output, (extra, output)
    assert src.read_bytes() == before and not out.exists() and not metrics.exists()


def test_hard_links_and_symlinks_of_the_input_are_the_input(tmp_path: Path) -> None:
    src = lines(tmp_path / "in.jsonl")
    before = src.read_bytes()
    hard, soft = tmp_path / "hard.jsonl", tmp_path / "soft.jsonl"
    os.link(src, hard)
    soft.symlink_to(src)
    for alias in (hard, soft):
        for extra in (["-o", str(alias), "--overwrite"], ["-o", str(alias), "--resume"]):
            code, output = generate(str(src), "--model", NO_MODEL, *extra)
            assert code == 2 and "is the input file" in output, output
        for option in ("--metrics", "--prefix-cache"):
            code, output = generate(str(src), "--model", NO_MODEL, option, str(alias))
            assert code == 2 and "is the input file" in output, output
    assert src.read_bytes() == before
    out = tmp_path / "out.jsonl"
    out.write_text("")
    os.link(out, tmp_path / "m.json")
    code, output = generate(str(src), "-o", str(out), "--metrics", str(tmp_path / "m.json"))
    assert code == 2 and "name the same file" in output


def test_a_file_that_is_not_this_engines_cache_is_kept(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    src = lines(tmp_path / "in.jsonl")
    model = ["--model", str(tiny_llama_dir), "--max-tokens", "2"]
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"someone's notes, not a cache\n")
    other = tmp_path / "block8.safetensors"  # a valid cache, of another block size
    code, output = generate(str(src), *model, "--block-size", "8", "--prefix-cache", str(other))
    assert code == 0 and "saved to" in output, output
    for path in (notes, other):
        before = path.read_bytes()
        code, output = generate(str(src), *model, "--prefix-cache", str(path))
        assert code == 0, output
        assert "starting cold" in output and "kept as it is" in output and "not saved" in output
        assert path.read_bytes() == before
    code, output = generate(str(src), *model, "--prefix-cache", str(notes), "--overwrite")
    assert code == 0 and "saved to" in output, output
    code, output = generate(str(src), *model, "--prefix-cache", str(notes))
    assert code == 0 and "loaded from" in output and "saved to" in output, output
