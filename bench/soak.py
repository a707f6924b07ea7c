"""The soak driver: a mixed stream of requests through one LLM with a small KV pool, the engine
loop driven by hand so the block manager can be checked after every step. What is checked is
listed in scripts/soak.py (the command line); the checks live in bench/soak_checks.py."""

from __future__ import annotations

import gc
import time
from collections import OrderedDict

import psutil

from bench.soak_checks import (
    FirstAdmissionCounter,
    ReferenceCheck,
    SoakReport,
    check_consistency,
    final_checks,
)
from bench.soak_workload import Request, Workload
from runner.engine.api.interface import EngineInterface
from runner.engine.api.llm import LLM
from runner.engine.sequence import Sequence


def _rss_mb() -> float:
    gc.collect()  # so garbage waiting for a collection is not counted as growth
    return psutil.Process().memory_info().rss / 2**20


def run_soak(
    model: str,
    requests: int = 10_000,
    *,
    num_kv_blocks: int = 64,
    block_size: int = 4,
    inflight: int = 32,
    seed: int = 0,
    chunk: int = 1000,
    check_every: int = 1,
    max_rss_growth: float | None = 0.10,
    record_metrics: bool = True,
    batching: str = "continuous",
    max_num_batched_tokens: int = 2048,
    cpu_weight_dtype: str = "float32",
    speculative_tokens: int = 0,
    kv_cache_dtype: str = "auto",
) -> SoakReport:
    """Run `requests` requests (at most `inflight` live) and return the report; a failed check
    is a line in `report.failures`, never an exception."""
    max_prompt = num_kv_blocks * block_size // 2 - 8
    llm: EngineInterface = LLM(
        model,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        seed=seed,
        batching=batching,
        max_num_batched_tokens=max_num_batched_tokens,
        record_metrics=record_metrics,
        cpu_weight_dtype=cpu_weight_dtype,
        speculative_tokens=speculative_tokens,
        kv_cache_dtype=kv_cache_dtype,
    )
    # With guesses on, greedy answers are compared with an engine that guesses nothing.
    checker = (
        ReferenceCheck(LLM(model, num_kv_blocks=512, kv_cache_dtype=kv_cache_dtype))
        if speculative_tokens
        else None
    )
    counter = FirstAdmissionCounter()
    llm.add_schedule_listener(counter)
    workload = Workload(seed, max_prompt=min(max_prompt, 80))
    rep = SoakReport(requests=requests, num_blocks=num_kv_blocks)
    live: dict[str, tuple[Request, Sequence]] = {}
    # Bounded: check_consistency keeps only the most recent prompts.
    greedy: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
    canary_out: dict[int, list[int]] = {}
    tally = {"cached": 0, "wrong_start": 0, "seen": 0}
    submitted = 0
    start = time.perf_counter()

    def fail(message: str) -> None:
        if len(rep.failures) < 20:
            rep.failures.append(message)

    while rep.finished < requests:
        while submitted < requests and (inflight <= 0 or len(live) < inflight):
            req = workload.next(submitted)
            rep.kinds[req.kind] = rep.kinds.get(req.kind, 0) + 1
            try:
                seq = llm.add_request(req.prompt, req.params, cache_salt=req.salt)
            except ValueError as err:
                fail(f"request {submitted} refused: {err}")
                return rep
            rep.prompt_tokens += len(req.prompt)
            live[seq.request_id] = (req, seq)
            submitted += 1
        if not llm.has_unfinished():
            fail(f"{len(live)} requests live but the engine has nothing to run: lost requests")
            break
        outputs = llm.step()
        rep.steps += 1
        if check_every and rep.steps % check_every == 0:
            try:
                llm.check_integrity()
            except AssertionError as err:
                fail(f"step {rep.steps}: integrity: {err}")
                break
        for out in outputs:
            if out.request_id not in live:
                fail(f"request {out.request_id} finished twice or was never submitted")
                continue
            req, seq = live.pop(out.request_id)
            rep.finished += 1
            if out.finish_reason not in ("stop", "length") or not out.token_ids:
                fail(f"request {out.request_id}: reason {out.finish_reason!r}, {out.token_ids}")
            allowed = set(req.params.allowed_token_ids or out.token_ids)
            if len(out.token_ids) < req.params.min_tokens or not set(out.token_ids) <= allowed:
                fail(f"request {out.request_id}: {out.token_ids} break its logit rules")
            got = None if out.logprobs is None else len(out.logprobs)
            expected = None if req.params.logprobs is None else len(out.token_ids)
            if got != expected:
                fail(f"request {out.request_id}: {got} logprobs for {expected} tokens")
            prompt_figures = out.prompt_logprobs
            if (req.params.prompt_logprobs is None) != (prompt_figures is None) or (
                prompt_figures is not None
                and [x is None for x in prompt_figures] != [i == 0 for i in range(len(req.prompt))]
            ):
                fail(f"request {out.request_id}: prompt logprobs do not cover its prompt")
            rep.output_tokens += len(out.token_ids)
            if checker is not None:
                checker.add(req, out.token_ids)
                checker.flush(rep, fail)
            tally["cached"] += out.num_cached_tokens
            rep.miss_tokens += counter.misses(seq, tally)
            workload.feedback(req.prompt, out.token_ids, req.salt)
            check_consistency(req, out.token_ids, greedy, tally, canary_out, workload, fail)
            if rep.finished % chunk == 0:
                rep.rss_mb.append(_rss_mb())
    rep.seconds = time.perf_counter() - start
    rep.greedy_prompts_compared = tally["seen"]
    rep.canary_copies = rep.kinds.get("canary", 0)
    if checker is not None:
        checker.flush(rep, fail, at_least=1)
    final_checks(llm, rep, tally, fail)
    if max_rss_growth is not None and len(rep.rss_mb) >= 2 and rep.rss_growth > max_rss_growth:
        fail(f"RSS grew {rep.rss_growth:.1%} (> {max_rss_growth:.0%}): {rep.rss_mb}")
    return rep
