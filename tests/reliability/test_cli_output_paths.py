"""Every file the command line writes is refused, before anything loads, unless it is a regular
file or nothing yet (issue 42): `generate --metrics /dev/full` run as root replaced the device
with a JSON file. The cases here cannot damage the machine if the check regresses: a FIFO and a
folder in tmp_path, and a symlink in tmp_path to /dev/zero where the old code only ever renamed
a file over the link itself or wrote into /dev/zero (which takes anything)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import click
from click.testing import CliRunner

from cli import main

METRICS = Path(__file__).resolve().parents[1] / "fixtures" / "metrics_continuous.json"


def _input(tmp_path: Path) -> Path:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": [5, 6, 7]}) + "\n")
    return src


def _is_fifo(path: Path) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def test_generate_refuses_metrics_on_a_fifo_before_the_model_loads(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    fifo = tmp_path / "metrics"
    os.mkfifo(fifo)
    args = ["generate", str(_input(tmp_path)), "--model", str(tiny_llama_dir), "--max-tokens", "2"]
    result = CliRunner().invoke(main, [*args, "--metrics", str(fifo)])
    assert result.exit_code == 2, result.output
    assert "--metrics" in result.output and "not a regular file but a FIFO" in result.output
    assert _is_fifo(fifo)  # not replaced by a JSON file
    assert "[a]" not in result.output  # refused before anything ran


def test_generate_refuses_metrics_through_a_symlink_to_a_device(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to("/dev/zero")
    args = ["generate", str(_input(tmp_path)), "--model", str(tmp_path / "no-such-model")]
    result = CliRunner().invoke(main, [*args, "--metrics", str(link)])
    assert result.exit_code == 2, result.output
    assert "a character device" in result.output and "no-such-model" not in result.output
    assert link.is_symlink()


def test_report_refuses_html_that_is_not_a_file(tmp_path: Path) -> None:
    link = tmp_path / "page.html"
    link.symlink_to("/dev/zero")
    result = CliRunner().invoke(main, ["report", str(METRICS), "--html", str(link)])
    assert result.exit_code == 2 and "--html" in result.output, result.output
    assert "a character device" in result.output
    assert "hit rate" not in result.output.lower()  # refused before the summary


def test_bench_refuses_json_that_is_not_a_file(tmp_path: Path) -> None:
    fifo = tmp_path / "bench.json"
    os.mkfifo(fifo)
    # --json first: it is checked as it is parsed, before the (unknown) systems fail the run
    result = CliRunner().invoke(main, ["bench", "--json", str(fifo), "--systems", "nothing"])
    assert result.exit_code == 2 and "--json" in result.output, result.output
    assert "a FIFO" in result.output and _is_fifo(fifo)


def test_bench_refuses_the_schedules_file_beside_json(tmp_path: Path) -> None:
    """engine-pd's schedules go to FILE.engine-pd.metrics.json: checked before any server
    starts (a model that does not exist would be the first thing the runs touch)."""
    out = tmp_path / "pd.json"
    os.mkfifo(tmp_path / "pd.engine-pd.metrics.json")
    args = ["bench", "--workload", "pd_interference", "--json", str(out)]
    result = CliRunner().invoke(main, [*args, "--model", str(tmp_path / "no-such-model")])
    assert result.exit_code == 2 and "--json" in result.output, result.output
    assert "pd.engine-pd.metrics.json is not a regular file" in result.output


def test_bench_serve_refuses_result_json_that_is_not_a_file(tmp_path: Path) -> None:
    link = tmp_path / "result.json"
    link.symlink_to("/dev/zero")
    args = ["bench-serve", "--result-json", str(link), "--base-url", "http://127.0.0.1:9"]
    result = CliRunner().invoke(main, [*args, "--dataset", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "--result-json" in result.output, result.output
    assert "a character device" in result.output


def test_every_option_that_writes_a_file_is_checked() -> None:
    """Each command's file options: the ones that must exist are read; every other one (a path
    the command writes) carries the one check, so a new writing option cannot skip it."""
    from runner.cli.batch.paths import OutputFile

    unchecked = []
    for command in main.commands.values():
        for param in command.params:
            kind = param.type
            if isinstance(kind, click.Path) and kind.file_okay and not kind.exists:
                unchecked.append(f"{command.name} {param.opts[0]}")
    assert unchecked == []
    checked = {
        f"{command.name} {param.opts[-1]}"
        for command in main.commands.values()
        for param in command.params
        if isinstance(param.type, OutputFile)
    }
    assert checked == {
        "generate --output",
        "generate --metrics",
        "generate --prefix-cache",
        "report --html",
        "bench --json",
        "bench-serve --result-json",
    }
