"""The soak (bench/soak.py; command line scripts/soak.py): a mixed stream of requests through
one LLM with a small pool.

The default run does 300 requests in-process (~2 s); `pytest -m soak` runs the script itself
for 10,000 requests (~30 s on one CPU thread) and holds it to every check, memory included."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.soak import run_soak
from kvcache import BlockManager
from runner.engine.step import tokens
from runner.engine.step.scheduler import Scheduler

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_short_soak_holds_every_check(tiny_llama_dir: Path) -> None:
    rep = run_soak(str(tiny_llama_dir), 300, chunk=100, max_rss_growth=None)
    assert rep.failures == [], rep.table()
    assert rep.finished == 300 and rep.cache.blocks_in_use == 0
    assert set(rep.kinds) == {"canary", "repeat", "shared", "turn", "unique"}
    # The workload really exercises what it claims to: hits, evictions, preemptions, repeats.
    assert rep.cache.hit_tokens > 0 and rep.miss_tokens > 0
    assert rep.cache.hit_tokens + rep.miss_tokens == rep.cache.query_tokens == rep.prompt_tokens
    assert rep.cache.evicted_blocks > 0 and rep.preemptions > 0
    assert rep.greedy_prompts_compared > 0 and rep.canary_copies >= 6


def test_speculative_soak_answers_as_an_engine_without_guesses(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With guessed tokens checked each step, every greedy answer equals a plain engine's;
    and the check can fail: an acceptance that keeps one guess too many is caught."""
    rep = run_soak(str(tiny_llama_dir), 300, chunk=100, max_rss_growth=None, speculative_tokens=4)
    assert rep.failures == [], rep.table()
    assert rep.accepted_tokens > 0 and rep.reference_checked > 100

    def one_too_many(draft: list[int], targets: list[int]) -> list[int]:
        kept = 0
        while kept < len(draft) and draft[kept] == targets[kept]:
            kept += 1
        return draft[: kept + 1] if kept < len(draft) else targets

    monkeypatch.setattr(tokens, "accepted", one_too_many)
    broken = run_soak(
        str(tiny_llama_dir), 300, chunk=100, max_rss_growth=None, speculative_tokens=4
    )
    assert any("without" in failure for failure in broken.failures), broken.table()


def test_soak_catches_a_leaked_block(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness can fail: a scheduler that forgets to free one finished request is caught."""
    real_finish = Scheduler.finish

    def leaky_finish(self: Scheduler, seq: Any, reason: str) -> None:
        if seq.seq_id == 7:
            self.bm.free = lambda request_id, *tail: None  # type: ignore[method-assign]
        real_finish(self, seq, reason)
        vars(self.bm).pop("free", None)

    monkeypatch.setattr(Scheduler, "finish", leaky_finish)
    rep = run_soak(str(tiny_llama_dir), 60, chunk=20, max_rss_growth=None)
    assert rep.cache.blocks_in_use > 0
    assert any("leak" in failure for failure in rep.failures), rep.failures


def test_soak_catches_wrong_hit_accounting(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """... and a hit counter that drifts from what the model was actually spared."""
    real_allocate = BlockManager.allocate

    def overcounting(self: BlockManager, *args: Any, **kwargs: Any) -> Any:
        result = real_allocate(self, *args, **kwargs)
        self._stats.hit_tokens += 1
        return result

    monkeypatch.setattr(BlockManager, "allocate", overcounting)
    rep = run_soak(str(tiny_llama_dir), 40, chunk=20, max_rss_growth=None)
    assert any("hit" in failure for failure in rep.failures), rep.failures


@pytest.mark.soak
def test_soak_ten_thousand_requests(tiny_llama_dir: Path) -> None:
    """The script end to end: exit code 0 means every request finished once, nothing leaked,
    the accounting adds up, answers agree, and RSS grew < 10% from request 1,000 to 10,000."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "10000", "--model", str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "10000 / 10000" in proc.stdout and "PASS" in proc.stdout
