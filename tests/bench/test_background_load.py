"""`kvcache bench --background-load N`: the spinners run while the block runs and none is left
after it, whether the block ends, raises, or the bench itself is killed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.background_load import background_load
from bench.harness import run_bench


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_spinners_run_inside_the_block_and_are_gone_after() -> None:
    with background_load(2) as spinners:
        assert len(spinners) == 2
        time.sleep(0.5)
        for spinner in spinners:
            assert spinner.poll() is None  # still spinning
            assert psutil.Process(spinner.pid).cpu_times().user > 0
    assert all(spinner.poll() is not None for spinner in spinners)
    assert all(_gone(s.pid) for s in spinners)


def test_spinners_are_killed_when_the_block_raises() -> None:
    with pytest.raises(KeyboardInterrupt), background_load(1) as spinners:
        raise KeyboardInterrupt  # as ctrl-c would
    assert spinners[0].poll() is not None


def test_a_spinner_stops_when_the_bench_is_killed_outright() -> None:
    """SIGKILL runs no cleanup: the orphaned spinner sees its parent gone and ends itself."""
    code = (
        "import time\n"
        "from bench.background_load import background_load\n"
        "with background_load(1) as s:\n"
        "    print(s[0].pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    bench = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root
    )
    assert bench.stdout is not None
    pid = int(bench.stdout.readline())
    assert psutil.pid_exists(pid)
    bench.kill()
    bench.wait()
    assert _gone(pid)


def test_a_negative_load_is_refused() -> None:
    with pytest.raises(ValueError, match="background load"), background_load(-1):
        pass


def test_the_bench_notes_the_load_and_leaves_no_spinner(tiny_llama_tok_dir: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = run_bench(
        "mixed_lengths",
        ["engine"],
        model=str(tiny_llama_tok_dir),
        max_tokens=3,
        limit=2,
        check=False,
        background=1,
    )
    assert "background load: 1 spinning process on" in result["table"]
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after - before == set() or all(_gone(pid) for pid in after - before)
