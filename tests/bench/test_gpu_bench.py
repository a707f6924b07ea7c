"""The GPU bench (`python -m bench.gpu.bench`) on the CPU at toy sizes: its workload, its
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

from bench.gpu.floor import ModelBytes, decode_floor, model_bytes
from bench.gpu.shared_prefix import make_shared_prefix_workload, step_bytes_report
from bench.gpu.workload import build_random_model, make_workload
from bench.hf_continuous import tokens_in_flight
from bench.peers import load_hf_model
from bench.workloads import BenchRequest

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
    """`python -m bench.gpu.bench --device cpu --quick` runs end to end and writes its
    JSON."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "bench.gpu.bench", "--device", "cpu", "--quick"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["correctness"]["equal"], report["correctness"]
    assert report["correctness"]["shared_prefix_steps"] > 0  # the prompts formed a group
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
    floor = report["decode_floor"]  # decode time beside the bytes it must read
    assert floor["floor_s"] > 0 and floor["over_floor"] == timed["decode_s"] / floor["floor_s"]


def test_gpu_bench_keeps_going_after_a_failed_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A phase that raises records its error and the next phases still run; a peer stopped at
    its deadline reports what finished, and no ratio is claimed from incomplete runs."""
    import bench.gpu.bench as gpu_bench

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
    import bench.gpu.bench as gpu_bench

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


def test_shared_prefix_workload_shares_one_system_prompt() -> None:
    a = make_shared_prefix_workload(256, 2048, (50, 200), 128, (0, 10000), seed=0)
    assert a == make_shared_prefix_workload(256, 2048, (50, 200), 128, (0, 10000), seed=0)
    system = a[0].prompt_token_ids[:2048]
    for r in a:
        assert r.prompt_token_ids[:2048] == system and r.max_tokens == 128
        assert 50 <= len(r.prompt_token_ids) - 2048 <= 200
    assert len({tuple(r.prompt_token_ids[2048:2060]) for r in a}) == 256  # their own parts


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU machine scripts/gpu_check.sh runs the real bench"
)
def test_shared_prefix_workload_quick_cpu(tmp_path: Path) -> None:
    """The shared-prefix workload four ways at toy sizes: every way completes with the same
    greedy tokens, only the last reads the system prompt once (through the Triton kernels, in
    the interpreter), and a step's bytes drop to the ideal."""
    import bench.gpu.bench as gpu_bench

    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--quick", "--workload", "shared-prefix", "--out", str(out)]
    report = gpu_bench.main(args)
    ways = report["shared_prefix"]
    for name in ("cache_off", "cache_on", "cache_on_eager", "shared_prefix"):
        assert ways[name]["complete"], ways[name]
        assert ways[name]["same_tokens_as_cache_on"] is True, name
        assert ways[name]["decode_floor"]["floor_s"] > 0
    # The bytes come from the plans the steps executed: none in the eager baseline, where
    # each row reads the prefix itself; one a step with shared-prefix attention, where a
    # group of 4 in one chunk reads exactly the ideal.
    plain, shared = (
        ways["cache_on_eager"]["executed_reads"],
        ways["shared_prefix"]["executed_reads"],
    )
    assert plain["steps_with_a_plan"] == 0 and plain["read_over_ideal"] > 1.0
    assert shared["steps_with_a_plan"] == shared["decode_steps_counted"]
    assert shared["decode_steps_counted"] >= ways["shared_prefix"]["decode_steps"]
    assert shared["full_batch"] == 4 and shared["full_batch_read_over_ideal"] == 1.0
    step = ways["step_bytes"]
    assert step["kv_bytes_shared_prefix"] < step["kv_bytes_plain"]
    assert step["shared_over_ideal"] == 1.0  # 4 members: one chunk reads the prefix once
    assert json.loads(out.read_text())["shared_prefix"]["step_bytes"] == step


def test_model_bytes_count_the_checkpoint(tmp_path: Path) -> None:
    """The tiny model (untied: its embedding is looked up, its LM head read) in float32, and
    in bf16 (the K/V and weights at 2 bytes)."""
    folder = build_random_model("tiny", tmp_path / "tiny", torch.float32, "cpu")
    hf = load_hf_model(folder, "cpu")
    params = sum(p.numel() for p in hf.parameters())
    embedding = hf.get_input_embeddings().weight.numel()
    sizes = model_bytes(folder, torch.float32)
    assert sizes == ModelBytes((params - embedding) * 4, 2 * 2 * 32 * 4, 2, 2)
    assert model_bytes(folder, torch.bfloat16) == ModelBytes(
        (params - embedding) * 2, 2 * 2 * 32 * 2, 2, 2
    )


def test_decode_floor_and_step_bytes_exactly() -> None:
    """Two requests: prompts of 3 and 5 tokens, 3 and 2 new ones. The first token of each is
    the prefill's; the decodes feed tokens 1 and 2 of the first (contexts 4 and 5) and token 1
    of the second (context 6); 100 bytes a token a layer, 2 layers; 4 decode steps each
    reading 1,000 bytes of weights; 1,000 bytes/s."""
    sizes = ModelBytes(weights=1000, kv_per_token=100, num_layers=2, gqa=2)
    requests = [BenchRequest("a", [1, 2, 3], 3), BenchRequest("b", [1, 2, 3, 4, 5], 2)]
    floor = decode_floor(requests, sizes, decode_steps=4, bytes_per_s=1000.0)
    assert floor["kv_bytes"] == (4 + 5 + 6) * 100 * 2
    assert floor["weight_bytes"] == 4000
    assert floor["floor_s"] == (3000 + 4000) / 1000.0
    # A step halfway: 3 requests behind a 32-token prefix (2 blocks of 16), contexts 40, 42, 44.
    shared = [BenchRequest(str(i), [7] * 32 + [i] * (6 + 2 * i), 4) for i in range(3)]
    got = step_bytes_report(shared, 32, sizes, 16, torch.bfloat16, 1000.0)
    assert got["kv_bytes_plain"] == (40 + 42 + 44) * 100 * 2
    assert got["kv_bytes_shared_prefix"] == got["kv_bytes_ideal"] == (32 + 8 + 10 + 12) * 200
    assert got["floor_ms_plain"] == 1e3 * (25200 + 1000) / 1000.0


def test_gpu_cascade_quick_cpu(tmp_path: Path) -> None:
    """The cost model's measurement (bench/gpu/cascade.py) at toy sizes in the
    interpreter: both decodes agree at every point, and the fit is reported."""
    from bench.gpu import cascade as gpu_cascade

    out = tmp_path / "cascade.json"
    report = gpu_cascade.main(["--device", "cpu", "--quick", "--out", str(out)])
    assert len(report["points"]) == 4
    for point in report["points"]:
        assert point["max_abs_diff"] < 1e-5 and point["plain_us"] > 0 and point["shared_us"] > 0
        assert point["model_says"] is False  # toy prefixes never pay
    assert report["fit"]["keeps_rule"] is True
    assert json.loads(out.read_text())["fit"] == report["fit"]
