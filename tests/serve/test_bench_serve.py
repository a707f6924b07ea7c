"""`kvcache bench-serve` against a real server: every turn of every session succeeds, later
turns hit the prefix cache (each carries the one before it and its answer), and the report
has the latency percentiles, throughput and hit rate; behind a router, the spread too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.serve.report import percentile
from cli import main
from tests.serve.conftest import LiveServer

REPO = Path(__file__).resolve().parents[2]


def test_bench_serve_multi_turn(server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench-serve", "--base-url", server.url, "--dataset", str(REPO / "data/sample.jsonl")]
    args += ["--num-prompts", "4", "--turns", "3", "--max-tokens", "4", "--max-concurrency", "2"]
    # the tiny model's 512-token context: no shared brief, short follow-ups
    args += ["--no-system-prompt", "--follow-up-chars", "0"]
    args += ["--ignore-eos", "--result-json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Serving Benchmark Result" in result.output
    summary = json.loads(out.read_text())
    assert summary["successful"] == 12 and summary["failed"] == 0, summary["errors"]
    assert summary["output_tokens"] == 12 * 4
    assert summary["hit_rate"] > 0.3  # turns 2 and 3 find the turns before them cached
    assert summary["p50_ttft_ms"] > 0 and summary["p99_e2e_ms"] >= summary["p50_e2e_ms"]
    assert "requests_per_replica" not in summary  # a server, not a router
    # One server keeps every conversation: it gets the ceiling, which round robin over one
    # replica is too.
    ceiling = summary["model_hit_rate_ceiling"]
    assert summary["model_hit_rate_round_robin"] == pytest.approx(ceiling)
    assert summary["hit_rate"] == pytest.approx(ceiling, abs=0.05)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 4.6
