"""A full disk under `kvcache generate`: the run stops with "disk full: N records kept ...;
free space and rerun with --resume", every record in OUTPUT is whole, no temporary file is left,
and once there is room again --resume finishes the run (issue 24, item 9).

The end-to-end test fills a real file system: a small tmpfs, which needs the right to mount one
(root); elsewhere it is skipped. The writer's own test writes to /dev/full, which fails every
write with ENOSPC as a full disk does, and runs anywhere on Linux."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill `disk` with one file, leaving about `leave` bytes free."""
    filler = disk / "filler"
    stat = os.statvfs(disk)
    filler.write_bytes(b"x" * max(0, stat.f_bavail * stat.f_frsize - leave))
    return filler


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # every line whole


def test_a_full_disk_keeps_whole_records_and_resume_finishes(
    tiny_llama_dir: Path, tmp_path: Path, small_disk: Path
) -> None:
    src = tmp_path / "in.jsonl"
    lines = ["{oops"] + [
        json.dumps({"id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7, 8]}) for i in range(60)
    ]
    src.write_text("\n".join(lines) + "\n")
    out, metrics = small_disk / "out.jsonl", small_disk / "m.json"
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir)]
    args += ["--max-tokens", "2"]
    filler = fill(small_disk, leave=8192)
    result = CliRunner().invoke(main, [*args, "--metrics", str(metrics)])
    assert result.exit_code == 1 and not isinstance(result.exception, OSError), result.output
    kept = records(out)
    assert 2 <= len(kept) < 61 and "error" in kept[0]
    assert f"disk full: {len(kept)} records kept in {out}; free space and rerun with --resume" in (
        result.output
    )
    assert "metrics: not written (No space left on device)" in result.output
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "out.jsonl"]
    # --resume would drop the error record, rewriting the file: no room for that either.
    before = out.read_bytes()
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 1 and "disk full" in result.output, result.output
    assert out.read_bytes() == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "out.jsonl"]
    filler.unlink()
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 1, result.output  # line 1 is still not JSON
    done = [r["id"] for r in records(out) if "error" not in r]
    assert sorted(done) == sorted(f"r{i}" for i in range(60))


def test_a_failed_write_raises_records_not_written(tmp_path: Path) -> None:
    from runner.cli.batch.file import ResultWriter
    from runner.cli.batch.records import RecordsNotWritten

    out = tmp_path / "out.jsonl"
    writer = ResultWriter(out, resume=False)
    writer.write({"id": "a", "text": "kept"})
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, writer._fd)  # the writer's file now fails as a full disk does
    os.close(full)
    with pytest.raises(RecordsNotWritten, match="disk full: 1 records kept in .*--resume"):
        writer.write({"id": "b", "text": "lost"})
    writer.close()
    assert [r["id"] for r in records(out)] == ["a"]
