"""The GPU check's verdict: one line per target, from the JSON each stage of
scripts/gpu_check.sh wrote (a stage cut short leaves what it had measured).

`python -m bench.gpu.verdict DIR [--tests-rc N]` prints, for each target, `PASS`, `FAIL` or
`NOT RUN` with the figure it was judged on, and exits 0 when every target passed. The targets
(one H200, one run each):

- the CUDA tests pass (their exit code, handed in);
- nano-vllm's benchmark (Qwen3-0.6B shape): at least 22,000 output tok/s, decode within 1.5x
  of its memory floor;
- the SmolLM2-135M shape: at least 45,000 output tok/s;
- the shared-prefix workload with the engine's defaults (`cache_on`: decode graphs that replay
  shared-prefix attention): the K/V bytes of a full-batch decode step, as its executed plans
  read them, at most 1.2x the ideal, and a wall time of at most 1.73 s;
- float32 greedy output equal to transformers', with a prefix group read once in it;
- deterministic mode: every request run alone equals its answer in the batch (256/256).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Verdict = tuple[str, str]  # (PASS | FAIL | NOT RUN, the figure)

NANO_TOK_S = 22_000
NANO_OVER_FLOOR = 1.5
SMOLLM2_TOK_S = 45_000
SHARED_OVER_IDEAL = 1.2
SHARED_WALL_S = 1.73
DETERMINISTIC = 256

# The stages' files, beside the result file (scripts/gpu_check.sh names them so).
FILES = {
    "nano": "gpu_bench.json",
    "smollm2": "gpu_smollm2.json",
    "shared": "gpu_shared_prefix.json",
    "greedy": "gpu_greedy.json",
    "determinism": "gpu_determinism.json",
}


def _passed(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def tests(rc: int | None) -> Verdict:
    if rc is None:
        return "NOT RUN", "no exit code"
    return _passed(rc == 0), f"exit {rc}"


def throughput(report: dict[str, Any], tok_s: float, over_floor: float | None) -> Verdict:
    run = report.get("kvcache")
    if not isinstance(run, dict) or "output_tok_s" not in run:
        return "NOT RUN", str((run or {}).get("error", "no kvcache figures"))
    rate = float(run["output_tok_s"])
    figure = f"{rate:,.0f} tok/s (target {tok_s:,.0f})"
    ok = bool(run.get("complete")) and rate >= tok_s
    if over_floor is not None:
        floor = report.get("decode_floor", {}).get("over_floor")
        if floor is None:
            return "FAIL", figure + ", no decode floor"
        figure += f", decode {floor:.2f}x its floor (target {over_floor})"
        ok = ok and floor <= over_floor
    if not run.get("complete"):
        figure += ", incomplete"
    return _passed(ok), figure


def shared_prefix(report: dict[str, Any]) -> Verdict:
    ways = report.get("shared_prefix")
    if not isinstance(ways, dict):
        return "NOT RUN", "no shared_prefix figures"
    way = ways.get("cache_on")
    if not isinstance(way, dict) or "wall_s" not in way:
        return "NOT RUN", str((way or {}).get("error", "no cache_on figures"))
    reads = way.get("executed_reads", {})
    ratio = reads.get("full_batch_read_over_ideal")
    wall = float(way["wall_s"])
    replays = way.get("cuda_graph_prefix_replays", 0)
    figure = (
        f"bytes/step {ratio if ratio is None else round(ratio, 3)}x ideal "
        f"(target {SHARED_OVER_IDEAL}), wall {wall:.2f} s (target {SHARED_WALL_S}), "
        f"prefix replays {replays}"
    )
    eager = ways.get("shared_prefix", {}).get("executed_reads", {})
    if "full_batch_read_over_ideal" in eager:
        figure += f"; eager shared-prefix {eager['full_batch_read_over_ideal']:.3f}x"
    ok = (
        ratio is not None
        and ratio <= SHARED_OVER_IDEAL
        and wall <= SHARED_WALL_S
        and way.get("complete") is True
        and way.get("same_tokens_as_cache_on") is not False
    )
    return _passed(ok), figure


def greedy(report: dict[str, Any]) -> Verdict:
    check = report.get("correctness")
    if not isinstance(check, dict) or "equal" not in check:
        return "NOT RUN", str((check or {}).get("error", "no correctness figures"))
    steps = int(check.get("shared_prefix_steps", 0))
    figure = f"{check['prompts'] - len(check['mismatched_prompts'])}/{check['prompts']} equal"
    figure += f", {steps} decode steps read a prefix once"
    return _passed(bool(check["equal"]) and steps > 0), figure


def determinism(report: dict[str, Any]) -> Verdict:
    answers = report.get("answers")
    if not isinstance(answers, dict):
        return "NOT RUN", "no answers figures"
    mode = answers.get("deterministic")
    if not isinstance(mode, dict):
        return "NOT RUN", str(answers.get("error", "no answers figures"))
    alone, equal = int(answers["alone"]), int(mode["batch_1_equal"])
    figure = f"{equal}/{alone} alone equal to batched (target {DETERMINISTIC}/{DETERMINISTIC})"
    return _passed(equal == alone >= DETERMINISTIC), figure


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def verdicts(folder: Path, tests_rc: int | None) -> list[tuple[str, Verdict]]:
    """Each target's verdict from the stage files in `folder`."""
    judges: list[tuple[str, str, Callable[[dict[str, Any]], Verdict]]] = [
        ("nano-vllm", "nano", lambda r: throughput(r, NANO_TOK_S, NANO_OVER_FLOOR)),
        ("smollm2", "smollm2", lambda r: throughput(r, SMOLLM2_TOK_S, None)),
        ("shared-prefix", "shared", shared_prefix),
        ("float32-greedy", "greedy", greedy),
        ("deterministic", "determinism", determinism),
    ]
    out: list[tuple[str, Verdict]] = [("cuda-tests", tests(tests_rc))]
    for name, key, judge in judges:
        report = _load(folder / FILES[key])
        out.append((name, ("NOT RUN", "no JSON") if report is None else judge(report)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="where the stages wrote their JSON")
    p.add_argument("--tests-rc", type=int, help="the CUDA tests' exit code (none: not run)")
    args = p.parse_args(argv)
    results = verdicts(args.folder, args.tests_rc)
    for name, (status, figure) in results:
        print(f"{status:<7} {name:<15} {figure}", flush=True)
    return 0 if all(status == "PASS" for _, (status, _) in results) else 1


if __name__ == "__main__":
    sys.exit(main())
