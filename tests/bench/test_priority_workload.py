"""`kvcache bench --workload priority` (bench/priority.py): both policies run the same requests
to the same greedy tokens; under first come the urgent requests finish last, under priority
scheduling before the queue they arrived behind. Orders of finishing, not speeds: the
figures' ratios are the bench's to report."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from bench.command import bench
from bench.priority import priority_bench, table


def test_urgent_requests_overtake_the_queue_only_under_priority(tiny_llama_tok_dir: Path) -> None:
    rows = priority_bench(str(tiny_llama_tok_dir), limit=12)  # raises if the tokens differ
    by_policy = {row["batching"]: row for row in rows}
    assert list(by_policy) == ["continuous", "priority"]
    first_come, priority = by_policy["continuous"], by_policy["priority"]
    assert first_come["urgent_median_s"] >= first_come["background_median_s"]
    assert first_come["urgent_max_s"] == first_come["all_done_s"]  # the last to finish
    assert priority["urgent_max_s"] < priority["background_median_s"]
    assert "| priority |" in table(rows)


def test_the_workload_runs_from_the_command_line(tiny_llama_tok_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "priority.json"
    args = ["--workload", "priority", "--model", str(tiny_llama_tok_dir), "--limit", "8"]
    result = CliRunner().invoke(bench, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "| continuous |" in result.output and out.is_file()
