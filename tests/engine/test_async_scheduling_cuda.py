"""Asynchronous scheduling on a real GPU (skipped without CUDA): greedy output equal to the
synchronous loop's in float32 with CUDA graphs, chunked prefill and preemption; and the
measurement the GPU check prints (`pytest -s`): a SmolLM2-135M-shape bf16 model on a decode-
heavy workload, the loop synchronous then overlapped, its wall time and tokens a second each
way (written to $OUT/async_scheduling.json when $OUT is set). Nothing here asserts a speed."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache import LLM, SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
POOL = {"num_kv_blocks": 512}  # a fixed pool: sized from free memory, one engine takes it all


def _prompts(count: int, seed: int, low: int, high: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


@cuda
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enforce_eager": True},
        {"max_num_batched_tokens": 16},
        {"num_kv_blocks": 24, "block_size": 16},  # preempts
    ],
)
def test_overlapped_greedy_equals_synchronous_on_cuda(
    make_tiny_model: Callable[..., Path], options: dict[str, Any]
) -> None:
    path = make_tiny_model("llama")
    pool = {**POOL, **options}
    rng = random.Random(0)
    prompts = _prompts(12, 1, 4, 60, 200)
    params = [
        SamplingParams(max_tokens=rng.randint(1, 40), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    common = {"device": "cuda", "dtype": "float32", "attention_backend": "triton", **pool}
    plain = LLM(str(path), async_scheduling=False, **common)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    del plain
    llm = LLM(str(path), **common)  # on by default on CUDA
    assert llm.overlap is not None
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.overlap.synchronous_steps == 0
    if not options.get("enforce_eager"):
        assert llm.runner.graphs is not None and llm.runner.graphs.num_replays > 0
    llm.block_manager.check_integrity()


@cuda
def test_measure_overlap_on_a_decode_heavy_workload(tmp_path: Path) -> None:
    """The figure for docs/GPU.md: the same workload with the loop synchronous, then
    overlapped (greedy bf16: near-ties may flip between the two, so only the count of equal
    outputs is reported)."""
    from bench.gpu.workload import build_random_model

    path = build_random_model("smollm2-135m", tmp_path / "model", torch.bfloat16, "cuda")
    prompts = _prompts(128, 2, 64, 256, 10_000)
    rng = random.Random(3)
    params = [
        SamplingParams(max_tokens=rng.randint(128, 384), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    report: dict[str, Any] = {"workload": "128 seqs, prompts 64-256, outputs 128-384, bf16"}
    outputs: dict[str, list[list[int]]] = {}
    for name, overlapped in (("synchronous", False), ("overlapped", True)):
        llm = LLM(
            str(path),
            dtype="bfloat16",
            device="cuda",
            async_scheduling=overlapped,
            num_kv_blocks=8192,  # 128 x 640 tokens in blocks of 16, with room
        )
        warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        llm.generate(_prompts(4, 9, 16, 300, 10_000), warm)
        torch.cuda.synchronize()
        steps_before = llm.scheduler.step_count
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        generated = sum(len(o.token_ids) for o in outs)
        steps = llm.scheduler.step_count - steps_before
        report[name] = {
            "wall_s": round(wall, 3),
            "output_tok_s": round(generated / wall, 1),
            "engine_steps": steps,
            "synchronous_steps": llm.overlap.synchronous_steps if llm.overlap else None,
        }
        outputs[name] = [o.token_ids for o in outs]
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outputs["synchronous"], outputs["overlapped"], strict=True))
    report["equal_outputs"] = f"{same}/{len(prompts)}"
    report["speedup"] = round(report["synchronous"]["wall_s"] / report["overlapped"]["wall_s"], 3)
    print("\nasync_scheduling:", json.dumps(report))
    out_dir = os.environ.get("OUT")
    if out_dir:
        (Path(out_dir) / "async_scheduling.json").write_text(json.dumps(report, indent=1))
    assert all(len(o) == p.max_tokens for o, p in zip(outputs["overlapped"], params, strict=True))
