"""The GPU bench (`python -m runner.bench.gpu_bench`) on the CPU at toy sizes: its workload, its
phases, how it counts a transformers run cut short at its deadline, and when it claims a ratio.
On a GPU machine `scripts/gpu_check.sh` runs the real one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.bench.gpu_workload import build_random_model, make_workload
from runner.bench.hf_continuous import tokens_in_flight
from runner.bench.peers import load_hf_model

ROOT = Path(__file__).resolve().parents[2]


def test_workload_is_seeded_and_in_range() -> None:
    a = make_workload(64, 100, 1024, 1024, (0, 10000), seed=0)
    assert a == make_workload(64, 100, 1024, 1024, (0, 10000), seed=0)
    assert a != make_workload(64, 100, 1024, 1024, (0, 10000), seed=1)
    assert [r.request_id for r in a] == [str(i) for i in range(64)]
    for r in a:
        assert 100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024
        assert all(0 <= t <= 10000 for t in r.prompt_token_ids)
    lens = [len(r.prompt_token_ids) for r in a]
    assert max(lens) - min(lens) > 500  # spread over the range, not one length


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU machine scripts/gpu_check.sh runs the real bench"
)
def test_gpu_bench_quick_cpu(tmp_path: Path) -> None:
    """`python -m runner.bench.gpu_bench --device cpu --quick` runs end to end and writes its
    JSON."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "runner.bench.gpu_bench", "--device", "cpu", "--quick"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["correctness"]["equal"], report["correctness"]
    assert report["kvcache"]["output_tokens"] == report["workload"]["output_tokens"]
    assert report["hf_generate_batch"]["output_tokens"] == report["workload"]["output_tokens"]
    assert report["kvcache"]["complete"] and report["hf_generate_batch"]["complete"]
    assert report["ratio"]["kvcache_over_hf"] > 0
    profile = report["kvcache"]["step_profile"]  # whole decode steps under torch's profiler
    assert profile["steps"] == 12 and profile["wall_ms_per_step"] > 0
    assert profile["host_top"] and profile["requests_finished"] == profile["num_seqs"]
    timed = report["kvcache"]  # every timed step is a decode-only or a prefill step
    assert timed["decode_steps"] > 0 and timed["prefill_steps"] > 0
    assert 0 < timed["decode_s"] + timed["prefill_s"] <= timed["wall_s"]
    assert 1 <= timed["decode_batch_median"] <= report["workload"]["num_seqs"]


def test_gpu_bench_keeps_going_after_a_failed_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A phase that raises records its error and the next phases still run; a peer stopped at
    its deadline reports what finished, and no ratio is claimed from incomplete runs."""
    import runner.bench.gpu_bench as gpu_bench

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_bench, "run_kvcache", broken)
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--quick", "--out", str(out), "--hf-deadline-s", "0"]
    report = gpu_bench.main(args)
    assert "illegal memory access" in report["kvcache"]["error"]
    hf = report["hf_generate_batch"]
    assert hf["complete"] is False and hf["output_tokens"] < report["workload"]["output_tokens"]
    # transformers' running requests are found, so a cut-short run still counts their tokens
    assert isinstance(hf["in_flight_tokens"], int)
    assert hf["output_tokens"] == hf["finished_tokens"] + hf["in_flight_tokens"]
    assert report["ratio"]["kvcache_over_hf"] is None
    assert report["correctness"]["equal"]  # the last phase ran too
    assert json.loads(out.read_text())["ratio"] == report["ratio"]


@pytest.mark.parametrize(
    ("theirs", "claimed"),
    [
        ({"complete": True, "output_tok_s": 100.0, "errors": 0}, "both runs complete"),
        (  # stopped at its deadline, its running requests counted
            {"complete": False, "in_flight_tokens": 50, "output_tokens": 80, "wall_s": 9.0},
            "first 9 s",
        ),
        ({"complete": False, "in_flight_tokens": None, "output_tokens": 80}, None),  # not seen
        ({"complete": False, "in_flight_tokens": 0, "output_tokens": 0, "wall_s": 9.0}, None),
        ({"complete": False, "in_flight_tokens": 5, "output_tokens": 9, "errors": 1}, None),
    ],
)
def test_ratio_is_claimed_only_on_counted_runs(theirs: dict[str, Any], claimed: str | None) -> None:
    import runner.bench.gpu_bench as gpu_bench

    theirs = {"output_tok_s": 100.0, "wall_s": 1.0, **theirs}
    ratio = gpu_bench._ratio(
        {"kvcache": {"complete": True, "output_tok_s": 700.0}, "hf_generate_batch": theirs}
    )
    if claimed is None:
        assert ratio["kvcache_over_hf"] is None
    else:
        assert ratio["kvcache_over_hf"] == 7.0 and ratio["meets"] and claimed in ratio["basis"]
    incomplete_ours = {
        "kvcache": {"complete": False, "output_tok_s": 700.0},
        "hf_generate_batch": theirs,
    }
    assert gpu_bench._ratio(incomplete_ours)["kvcache_over_hf"] is None


def test_tokens_in_flight_counts_transformers_running_requests(tmp_path: Path) -> None:
    """The installed transformers' manager shows its running requests where tokens_in_flight
    looks: the count grows while requests run, before any of them finishes."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    hf = load_hf_model(build_random_model("tiny", tmp_path / "tiny", torch.float32, "cpu"), "cpu")
    config = GenerationConfig(max_new_tokens=400, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)
    seen: list[int | None] = []
    with (
        torch.no_grad(),
        hf.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb, block=True, timeout=5
        ) as manager,
    ):
        seen.append(tokens_in_flight(manager, {}))
        for i in range(3):
            manager.add_request([5 + i, 9, 11], request_id=str(i), max_new_tokens=400)
        stop_at = time.perf_counter() + 60
        while time.perf_counter() < stop_at and (seen[-1] or 0) < 20:
            seen.append(tokens_in_flight(manager, {}))
            time.sleep(0.005)
        finished = manager.get_result(timeout=0)
    assert seen[0] is not None and seen[-1] is not None and seen[-1] >= 20, seen[-5:]
    assert finished is None or not finished.is_finished()  # counted before any request ended
    assert all(isinstance(n, int) and 0 <= n <= 3 * 400 for n in seen)
