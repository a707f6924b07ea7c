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
    check_output,
    final_checks,
)
from bench.soak_workload import Request, Workload
from runner.engine.api.interface import EngineInterface
from runner.engine.api.llm import LLM
from runner.engine.requests.outputs import RequestOutput
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
    workload = Workload(seed, max_prompt=min(max_prompt, 80))
    soak = Soak(llm, checker, workload, SoakReport(requests=requests, num_blocks=num_kv_blocks))
    start = time.perf_counter()
    if not soak.run(inflight, check_every, chunk):
        return soak.rep
    rep = soak.rep
    rep.seconds = time.perf_counter() - start
    rep.greedy_prompts_compared = soak.tally["seen"]
    rep.canary_copies = rep.kinds.get("canary", 0)
    if checker is not None:
        checker.flush(rep, soak.fail, at_least=1)
    final_checks(llm, rep, soak.tally, soak.fail)
    if max_rss_growth is not None and len(rep.rss_mb) >= 2 and rep.rss_growth > max_rss_growth:
        soak.fail(f"RSS grew {rep.rss_growth:.1%} (> {max_rss_growth:.0%}): {rep.rss_mb}")
    return rep


class Soak:
    """One soak's stream through `llm`: requests submitted, the engine stepped (and checked)
    by hand, every answer checked as it ends; what it finds goes into `rep`."""

    def __init__(
        self,
        llm: EngineInterface,
        checker: ReferenceCheck | None,
        workload: Workload,
        rep: SoakReport,
    ) -> None:
        self.llm, self.checker, self.workload, self.rep = llm, checker, workload, rep
        self.counter = FirstAdmissionCounter()
        llm.add_schedule_listener(self.counter)
        self.live: dict[str, tuple[Request, Sequence]] = {}
        # Bounded: check_consistency keeps only the most recent prompts.
        self.greedy: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self.canary_out: dict[int, list[int]] = {}
        self.tally = {"cached": 0, "wrong_start": 0, "seen": 0}
        self.submitted = 0

    def fail(self, message: str) -> None:
        if len(self.rep.failures) < 20:
            self.rep.failures.append(message)

    def run(self, inflight: int, check_every: int, chunk: int) -> bool:
        """Until every request has finished, or a check stops the run; False where a request
        was refused (the report is then as it stands)."""
        rep = self.rep
        while rep.finished < rep.requests:
            if not self.submit(inflight):
                return False
            if not self.llm.has_unfinished():
                self.fail(
                    f"{len(self.live)} requests live but the engine has nothing to run: "
                    "lost requests"
                )
                break
            outputs = self.llm.step()
            rep.steps += 1
            if check_every and rep.steps % check_every == 0:
                try:
                    self.llm.check_integrity()
                except AssertionError as err:
                    self.fail(f"step {rep.steps}: integrity: {err}")
                    break
            for out in outputs:
                self.finish(out, chunk)
        return True

    def submit(self, inflight: int) -> bool:
        """Requests up to `inflight` live (none: no bound); False where one is refused."""
        while self.submitted < self.rep.requests and (inflight <= 0 or len(self.live) < inflight):
            req = self.workload.next(self.submitted)
            self.rep.kinds[req.kind] = self.rep.kinds.get(req.kind, 0) + 1
            try:
                seq = self.llm.add_request(req.prompt, req.params, cache_salt=req.salt)
            except ValueError as err:
                self.fail(f"request {self.submitted} refused: {err}")
                return False
            self.rep.prompt_tokens += len(req.prompt)
            self.live[seq.request_id] = (req, seq)
            self.submitted += 1
        return True

    def finish(self, out: RequestOutput, chunk: int) -> None:
        """One finished request: its answer checked, its figures counted."""
        rep = self.rep
        if out.request_id not in self.live:
            self.fail(f"request {out.request_id} finished twice or was never submitted")
            return
        req, seq = self.live.pop(out.request_id)
        rep.finished += 1
        check_output(req, out, self.fail)
        rep.output_tokens += len(out.token_ids)
        if self.checker is not None:
            self.checker.add(req, out.token_ids)
            self.checker.flush(rep, self.fail)
        self.tally["cached"] += out.num_cached_tokens
        rep.miss_tokens += self.counter.misses(seq, self.tally)
        self.workload.feedback(req.prompt, out.token_ids, req.salt)
        check_consistency(
            req, out.token_ids, self.greedy, self.tally, self.canary_out, self.workload, self.fail
        )
        if rep.finished % chunk == 0:
            rep.rss_mb.append(_rss_mb())
