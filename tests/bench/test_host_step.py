"""scripts/host_step.py (the host's time per engine step, which scripts/gpu_check.sh runs on the
GPU machine) runs end to end on a tiny model, with the model's forward and with it skipped, so a
rename in the model or the engine that it reaches into breaks this test, not the GPU check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", [[], ["--skip-forward"], ["--profile"]])
def test_host_step_runs(mode: list[str]) -> None:
    cmd = [sys.executable, "scripts/host_step.py", "--num-seqs", "4", "--prompt-len", "8"]
    cmd += ["--max-tokens", "6", *mode]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Every step past the prompts' decodes all four: the median is over real decode steps.
    assert "4 sequences, " in proc.stdout and "host time per step median" in proc.stdout
    if mode == ["--profile"]:
        assert "function calls" in proc.stdout  # cProfile's table
