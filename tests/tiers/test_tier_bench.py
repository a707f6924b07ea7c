"""`kvcache bench --workload tiers-*` with the figures' options: the per-block figure runs end to
end on a tiny model with a Redis server it starts itself (--redis auto), chunked values against
one block a value; an option a figure does not take, or a tiers option on another workload, is
a usage error naming it."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from cli import main


def test_the_per_block_figure_with_its_own_redis(tiny_llama_dir: Path) -> None:
    args = ["bench", "--workload", "tiers-per-block", "--model", str(tiny_llama_dir)]
    args += ["--prompt-tokens", "96", "--redis", "auto", "--cache-chunk-tokens", "64"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [line.split("|")[1:3] for line in result.output.splitlines() if line.startswith("| ")]
    cells = [(tier.strip(), chunk.strip()) for tier, chunk in rows[1:]]
    assert cells == [("host", "16"), ("disk", "64"), ("remote", "64"), ("disk", "16"),
                     ("remote", "16")]  # fmt: skip


def test_options_a_figure_does_not_take_are_usage_errors(tiny_llama_dir: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "--workload", "tiers-per-block", "--repeat", "2"])
    assert result.exit_code == 2 and "--repeat does not apply to tiers-per-block" in result.output
    result = runner.invoke(main, ["bench", "--workload", "core", "--redis", "auto"])
    assert result.exit_code == 2 and "tiers-* workloads only" in result.output
    result = runner.invoke(main, ["bench", "--workload", "tiers-restart", "--redis", "http://x"])
    assert result.exit_code == 2 and "--redis takes redis://" in result.output
