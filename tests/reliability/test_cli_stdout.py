"""Standard output that refuses writes (`kvcache generate ... > /dev/full`) ends a command with
one clear error line on stderr and exit status 1, never a traceback (issue 42). Opening
/dev/full for writing, as a shell redirect does, leaves the device as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
METRICS = REPO / "tests" / "fixtures" / "metrics_continuous.json"

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def _run_into_dev_full(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "cli", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=300,
        )


def _assert_one_clear_error(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "cannot write to stdout" in line]
    assert len(errors) == 1 and "No space left on device" in errors[0], result.stderr


def test_generate_printing_to_a_full_stdout(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    rows = [{"id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7]} for i in range(3)]
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    metrics = tmp_path / "m.json"
    args = [str(src), "--model", str(tiny_llama_dir), "--max-tokens", "2", "--metrics"]
    result = _run_into_dev_full("generate", *args, str(metrics))
    _assert_one_clear_error(result)
    assert "metrics written" in result.stderr and metrics.is_file()  # the run's files still saved


def test_report_to_a_full_stdout() -> None:
    _assert_one_clear_error(_run_into_dev_full("report", str(METRICS)))


def test_help_to_a_full_stdout() -> None:
    """Output outside the commands' own results (click's --help) is caught at the top."""
    _assert_one_clear_error(_run_into_dev_full("bench", "--help"))
