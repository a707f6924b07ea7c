"""`kvcache generate` with the tier options: a second run on the same --disk-cache directory
finds the first run's prefixes, with the same answers; --cache-chunk-tokens sets how many
blocks a stored value holds; sizes read as 2GiB / 512MB; a bad size, URL or chunk is a usage
error before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from runner.cli.sizes import parse_size


def test_sizes() -> None:
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512MB") == 512 * 10**6
    assert parse_size("4096") == 4096 and parse_size("1.5kib") == 1536
    with pytest.raises(ValueError, match="not a size"):
        parse_size("2 parsecs")


def test_a_second_run_gets_the_first_runs_prefixes(tiny_llama_dir: Path, tmp_path: Path) -> None:
    system = [3 + (i * 5) % 300 for i in range(48)]
    lines = [{"id": f"r{i}", "prompt_token_ids": system + [10 + i]} for i in range(3)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = []
    for run in range(2):
        out = tmp_path / f"out{run}.jsonl"
        args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir)]
        tiers = ["--disk-cache", str(tmp_path / "disk"), "--disk-cache-bytes", "64MiB"]
        tiers += ["--host-cache-bytes", "16MiB", "--cache-key", "secret"]
        result = CliRunner().invoke(main, [*args, "--max-tokens", "4", *tiers])
        assert result.exit_code == 0, result.output
        records.append({r["id"]: r for r in map(json.loads, out.read_text().splitlines())})
    assert records[0]["r0"]["cached_tokens"] == 0
    assert records[1]["r0"]["cached_tokens"] == 48  # the system prompt, from the disk
    assert {k: r["token_ids"] for k, r in records[0].items()} == {
        k: r["token_ids"] for k, r in records[1].items()
    }


@pytest.mark.parametrize(("chunk", "files"), [("48", 1), ("16", 3)])
def test_cache_chunk_tokens_sets_the_values_blocks(
    tiny_llama_dir: Path, tmp_path: Path, chunk: str, files: int
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [3 + (i * 7) % 300 for i in range(49)]}))
    disk = tmp_path / "disk"
    args = ["generate", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(tiny_llama_dir)]
    tiers = ["--disk-cache", str(disk), "--cache-chunk-tokens", chunk]
    result = CliRunner().invoke(main, [*args, "--max-tokens", "4", *tiers])
    assert result.exit_code == 0, result.output
    # Three full blocks of 16: one value of three blocks, or three of one.
    assert len(list(disk.glob("*.kvb"))) == files


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--host-cache-bytes", "lots"], "--host-cache-bytes"),
        (["--disk-cache-bytes", "0"], "--disk-cache-bytes"),
        (["--remote-cache", "http://x"], "--remote-cache"),
        (["--cache-chunk-tokens", "20"], "--cache-chunk-tokens"),
    ],
)
def test_bad_tier_options_fail_before_the_model_loads(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [5, 6, 7]}\n')
    base = ["generate", str(src), "--model", str(tmp_path / "no-such-model")]
    result = CliRunner().invoke(main, [*base, *flags])
    assert result.exit_code == 2, result.output
    assert named in result.output and "no-such-model" not in result.output


def test_the_report_shows_each_tier(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    prompts = [[3 + (i * 5) % 300 for i in range(48)] + [10 + i] for i in range(2)]
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    metrics = tmp_path / "m.json"
    args = ["generate", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(tiny_llama_dir)]
    tiers = ["--disk-cache", str(tmp_path / "disk"), "--host-cache-bytes", "1MiB"]
    result = CliRunner().invoke(main, [*args, "--metrics", str(metrics), *tiers])
    assert result.exit_code == 0, result.output
    report = CliRunner().invoke(main, ["report", str(metrics)])
    assert report.exit_code == 0, report.output
    assert "Cache tiers" in report.output and "dropped writes 0" in report.output
    rows = [line.split()[0] for line in report.output.splitlines() if line.split()[:1]]
    assert {"device", "host", "disk"} <= set(rows)
