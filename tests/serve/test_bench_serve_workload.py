"""The multi-turn workload's shape (no server needed) and what its hit-rate models say: every
session shares the system prompt and opens with its own line, each follow-up quotes another
line, the same seed gives the same sessions; the ceiling and round robin's expectation on
hand-made token counts; and the llama-server comparison skipped with one line when there is
no llama-server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.serve.hit_model import Turn, ceiling_hit_rate, round_robin_hit_rate
from bench.serve.llama_server import find_llama_server, server_command
from bench.serve.system_prompt import SYSTEM_PROMPT
from bench.serve.workload import (
    FOLLOW_UPS,
    PASSAGE_QUESTIONS,
    multi_turn_sessions,
    read_lines,
)
from cli import main
from tests.serve.conftest import LiveServer

REPO = Path(__file__).resolve().parents[2]


def test_sessions_share_the_system_prompt_and_quote_other_lines() -> None:
    rows = read_lines(REPO / "data/no_sharing.jsonl")
    sessions = multi_turn_sessions(rows, 20, 5, 64, seed=3)
    assert len(sessions) == 20 and all(s.turns == 5 for s in sessions)
    openings = [s.opening for s in sessions]
    assert all(o[0] == {"role": "system", "content": SYSTEM_PROMPT} for o in openings)
    firsts = [o[1]["content"] for o in openings]
    assert len(set(firsts)) == 20  # every conversation its own, cycled lines too
    assert firsts[0].startswith(rows[0]["prompt"]) and firsts[16].startswith("(conversation 16)")
    for session in sessions:
        for follow_up in session.follow_ups:
            head, rest = follow_up.split("\n\n", 1)
            passage, question = rest.rsplit("\n\n", 1)
            assert head == "Here is a related passage:"
            assert question in PASSAGE_QUESTIONS + FOLLOW_UPS
            assert len(passage) == 480
            assert any(passage in row["prompt"] for row in rows)
    assert multi_turn_sessions(rows, 20, 5, 64, seed=3) == sessions
    bare = multi_turn_sessions(rows, 2, 3, 8, seed=3, system_prompt=None, follow_up_chars=0)
    assert bare[0].opening[0]["role"] == "user" and "\n\n" not in bare[0].follow_ups[0]


def test_the_hit_rate_models() -> None:
    # each turn adds 10 of its own; the first found 40 shared tokens cached
    conv = [Turn(100, 10, 40), Turn(120, 10), Turn(140, 10)]
    # ceiling: 40 shared on turn 1, then the turn before with its answer (110, 130)
    assert ceiling_hit_rate([conv]) == pytest.approx((40 + 110 + 130) / 360)
    # one replica: round robin is the ceiling; two: turn 3 finds turn 2 (p 1/2), else turn 1
    assert round_robin_hit_rate([conv], 1) == pytest.approx(ceiling_hit_rate([conv]))
    expected = 40 + (110 / 2 + 40 / 2) + (130 / 2 + 110 / 4 + 40 / 4)
    assert round_robin_hit_rate([conv], 2) == pytest.approx(expected / 360)
    # two turns and nothing shared: exactly half the ceiling, the most round robin can lose
    pair = [[Turn(100, 10), Turn(120, 10)]]
    assert round_robin_hit_rate(pair, 2) == pytest.approx(ceiling_hit_rate(pair) / 2)


def test_the_llama_server_comparison_is_skipped_without_one(
    server: LiveServer, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    args = ["bench-serve", "--base-url", server.url, "--dataset", str(REPO / "data/sample.jsonl")]
    args += ["--num-prompts", "2", "--turns", "2", "--max-tokens", "2", "--no-system-prompt"]
    args += ["--follow-up-chars", "0", "--compare-llama-server", "--result-json", str(out)]
    result = CliRunner().invoke(main, args, env={"PATH": str(tmp_path)})  # no llama-server
    assert result.exit_code == 0, result.output
    skipped = [line for line in result.output.splitlines() if "llama-server" in line]
    assert skipped == [
        "llama-server comparison skipped: no llama-server on PATH (give --llama-server PATH)"
    ]
    summary = json.loads(out.read_text())
    assert summary["successful"] == 4 and "llama_server" not in summary
    assert 0 < summary["model_hit_rate_ceiling"] <= 1

    missing = CliRunner().invoke(main, [*args, "--llama-server", str(tmp_path / "nope")])
    assert missing.exit_code != 0 and "not an executable file" in missing.output


def test_llama_server_is_found_on_path_and_started_on_the_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server(None) == str(binary)
    cmd = server_command(str(binary), Path("/m/SmolLM2.gguf"), 8123, 4, "-t 1")
    assert cmd[:3] == [str(binary), "-m", "/m/SmolLM2.gguf"]
    assert cmd[cmd.index("-np") + 1] == "4" and cmd[-2:] == ["-t", "1"]
