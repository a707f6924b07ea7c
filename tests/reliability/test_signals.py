"""SIGTERM does what Ctrl-C does (a message, the prefix cache saved, exit 130), and a second
Ctrl-C while the files are saved stops at once without a traceback (issue 24, item 12)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cli import main
from runner.engine.step.guards import interrupts_held


def batch(path: Path, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {"id": f"r{i}", "prompt_token_ids": [3 + (i * 7 + k) % 200 for k in range(30)]}
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


def test_sigterm_is_held_like_sigint_while_the_books_are_written() -> None:
    from runner.cli.signals import sigterm_as_sigint

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_sigint():
        with pytest.raises(KeyboardInterrupt):
            with interrupts_held():
                signal.raise_signal(signal.SIGTERM)
                landed = True  # held: the block runs to its end first
        assert landed
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_saves_the_cache_and_says_so(tiny_llama_dir: Path, tmp_path: Path) -> None:
    n = 150
    src, out, cache = batch(tmp_path / "in.jsonl", n), tmp_path / "out.jsonl", tmp_path / "c.st"
    cmd = [sys.executable, "-m", "cli", "generate", str(src), "-o", str(out)]
    cmd += ["--model", str(tiny_llama_dir), "--max-tokens", "40", "--prefix-cache", str(cache)]
    cmd += ["--max-num-batched-tokens", "64"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted:" in stderr and "rerun with --resume" in stderr
    assert "Traceback" not in stderr
    assert "blocks saved to" in stderr and cache.stat().st_size > 0
    done = out.read_text().count("\n")
    assert 3 <= done < n, "the signal should land mid-run"


def test_a_second_ctrl_c_while_saving_has_no_traceback(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    from runner.engine.api.llm import LLM

    def first(self: LLM, on_finish: Any = None) -> Any:
        raise KeyboardInterrupt  # Ctrl-C in the run

    def second(self: LLM, path: Any) -> int:
        raise KeyboardInterrupt  # and again while the prefix cache is saved

    monkeypatch.setattr(LLM, "run_until_done", first)
    monkeypatch.setattr(LLM, "save_prefix_cache", second)
    src, cache = batch(tmp_path / "in.jsonl", 2), tmp_path / "c.st"
    args = ["generate", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(tiny_llama_dir)]
    result = CliRunner().invoke(main, [*args, "--prefix-cache", str(cache)])
    assert result.exit_code == 130 and isinstance(result.exception, SystemExit), result.output
    assert "interrupted: 0 requests" in result.output and "interrupted again" in result.output
    assert not cache.exists()
