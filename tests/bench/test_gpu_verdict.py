"""bench/gpu/verdict.py: the GPU check's closing lines, one per target, judged from the stage
files (here written by hand with figures on both sides of each target)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.gpu.verdict import FILES, main, verdicts


def write(folder: Path, key: str, report: dict[str, Any]) -> None:
    (folder / FILES[key]).write_text(json.dumps(report))


def passing(folder: Path) -> None:
    write(
        folder,
        "nano",
        {
            "kvcache": {"output_tok_s": 23_000.0, "complete": True},
            "decode_floor": {"over_floor": 1.4},
        },
    )
    write(folder, "smollm2", {"kvcache": {"output_tok_s": 46_000.0, "complete": True}})
    reads = {"full_batch_read_over_ideal": 1.1}
    cache_on = {
        "wall_s": 1.5,
        "complete": True,
        "same_tokens_as_cache_on": True,
        "executed_reads": reads,
        "cuda_graph_prefix_replays": 120,
    }
    write(folder, "shared", {"shared_prefix": {"cache_on": cache_on}})
    check = {"equal": True, "prompts": 8, "mismatched_prompts": [], "shared_prefix_steps": 15}
    write(folder, "greedy", {"correctness": check})
    answers = {"alone": 256, "requests": 256, "deterministic": {"batch_1_equal": 256}}
    write(folder, "determinism", {"answers": answers})


def test_every_target_met_passes(tmp_path: Path, capsys: Any) -> None:
    passing(tmp_path)
    assert main([str(tmp_path), "--tests-rc", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(line.startswith("PASS") for line in lines), lines


def test_each_target_missed_fails_alone(tmp_path: Path) -> None:
    passing(tmp_path)
    misses: list[tuple[str, str, Any]] = [
        ("nano", "decode_floor", {"over_floor": 1.6}),
        ("smollm2", "kvcache", {"output_tok_s": 44_000.0, "complete": True}),
        ("greedy", "correctness", {"equal": True, "prompts": 8, "mismatched_prompts": []}),
        ("determinism", "answers", {"alone": 256, "deterministic": {"batch_1_equal": 255}}),
    ]
    names = {"nano": "nano-vllm", "smollm2": "smollm2", "greedy": "float32-greedy"}
    names["determinism"] = "deterministic"
    for key, field, value in misses:
        report = json.loads((tmp_path / FILES[key]).read_text())
        saved = dict(report)
        report[field] = value
        write(tmp_path, key, report)
        got = dict(verdicts(tmp_path, 0))
        assert got[names[key]][0] == "FAIL", (key, got[names[key]])
        assert [n for n, (status, _) in got.items() if status != "PASS"] == [names[key]]
        write(tmp_path, key, saved)
    shared = json.loads((tmp_path / FILES["shared"]).read_text())
    shared["shared_prefix"]["cache_on"]["executed_reads"]["full_batch_read_over_ideal"] = 1.25
    write(tmp_path, "shared", shared)
    assert dict(verdicts(tmp_path, 0))["shared-prefix"][0] == "FAIL"


def test_a_missing_or_cut_stage_is_not_run(tmp_path: Path) -> None:
    passing(tmp_path)
    (tmp_path / FILES["smollm2"]).unlink()
    write(tmp_path, "determinism", {"answers": {"error": "RuntimeError('out of memory')"}})
    got = dict(verdicts(tmp_path, None))
    assert got["smollm2"] == ("NOT RUN", "no JSON")
    assert got["deterministic"][0] == "NOT RUN" and "out of memory" in got["deterministic"][1]
    assert got["cuda-tests"][0] == "NOT RUN"
    assert dict(verdicts(tmp_path, 1))["cuda-tests"] == ("FAIL", "exit 1")
