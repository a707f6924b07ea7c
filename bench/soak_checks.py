"""What the soak (bench/soak.py) verifies and reports: the report table, the miss counter
that watches what the model is actually fed, and the per-request and end-of-run checks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.soak_workload import Request, Workload
from kvcache import CacheStats
from runner.engine.api.interface import ServingEngine
from runner.engine.requests.outputs import RequestOutput
from runner.engine.sequence import Sequence
from runner.engine.step.scheduler import SchedulerOutput

Fail = Callable[[str], None]


@dataclass
class SoakReport:
    requests: int = 0
    finished: int = 0
    steps: int = 0
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    prompt_tokens: int = 0
    miss_tokens: int = 0
    preemptions: int = 0
    num_blocks: int = 0
    cache: CacheStats = field(default_factory=CacheStats)  # the engine's counters at the end
    greedy_prompts_compared: int = 0
    canary_copies: int = 0
    rss_mb: list[float] = field(default_factory=list)  # after each chunk of finished requests
    recorder_steps: int = 0
    recorder_requests: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    reference_checked: int = 0  # greedy/seeded answers compared with an engine that guesses nothing
    failures: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        if len(self.rss_mb) < 2:
            return 0.0
        return (self.rss_mb[-1] - self.rss_mb[0]) / self.rss_mb[0]

    def table(self) -> str:
        cache = self.cache
        rows = [
            ("requests finished", f"{self.finished} / {self.requests}"),
            ("kinds", ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items()))),
            ("engine steps", f"{self.steps}"),
            ("wall time", f"{self.seconds:.1f} s ({self.requests / self.seconds:.0f} req/s)"),
            ("output tokens", f"{self.output_tokens}"),
            ("query tokens", f"{cache.query_tokens} (prompts submitted: {self.prompt_tokens})"),
            (
                "hit + miss tokens",
                f"{cache.hit_tokens} + {self.miss_tokens} ({cache.hit_rate:.1%} hit)",
            ),
            ("readmission q/hit", f"{cache.readmit_query_tokens} / {cache.readmit_hit_tokens}"),
            ("preemptions", f"{self.preemptions}"),
            ("evicted blocks", f"{cache.evicted_blocks}"),
            ("blocks in use at end", f"{cache.blocks_in_use} of {self.num_blocks}"),
            ("greedy prompts seen 2+ times", f"{self.greedy_prompts_compared}"),
            ("canary copies", f"{self.canary_copies}"),
            (
                "metrics rows kept",
                f"{self.recorder_steps} steps, {self.recorder_requests} requests",
            ),
            ("guessed tokens kept", f"{self.accepted_tokens} / {self.draft_tokens}"),
            ("answers checked vs no guesses", f"{self.reference_checked}"),
            ("RSS per chunk (MB)", " ".join(f"{m:.0f}" for m in self.rss_mb)),
            ("RSS growth", f"{self.rss_growth:+.1%} (first chunk end -> last chunk end)"),
            ("result", "PASS" if not self.failures else f"FAIL ({len(self.failures)})"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        lines += [f"  failure: {f}" for f in self.failures]
        return "\n".join(lines)


class FirstAdmissionCounter:
    """A schedule listener (`ServingEngine.add_schedule_listener`) that counts the prompt
    tokens the model is fed while each request is in its first admission (before any
    preemption): the real cache misses."""

    def __init__(self) -> None:
        self.fed: dict[int, int] = {}
        self.first_start: dict[int, int] = {}

    def __call__(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            seq = item.seq
            if seq.num_preemptions or item.start >= seq.num_prompt_tokens:
                continue
            self.first_start.setdefault(seq.seq_id, item.start)
            end = min(item.start + item.num_new_tokens, seq.num_prompt_tokens)
            self.fed[seq.seq_id] = self.fed.get(seq.seq_id, 0) + end - item.start

    def misses(self, seq: Sequence, tally: dict[str, int]) -> int:
        """A finished request's miss tokens: prompt tokens fed in its first admission, plus, if
        it was preempted before that prefill ended, the rest of its prompt (not a hit either).
        Forgets the request, so the counter stays small."""
        fed = self.fed.pop(seq.seq_id, 0)
        start = self.first_start.pop(seq.seq_id, None)
        if start is not None and start != seq.num_cached_tokens:
            tally["wrong_start"] += 1
        if seq.num_preemptions:
            begin = seq.num_cached_tokens if start is None else start
            return seq.num_prompt_tokens - begin
        return fed


def check_output(req: Request, out: RequestOutput, fail: Fail) -> None:
    """One finished request's answer against its own rules: a real end, its logit rules kept,
    and the log-probabilities it asked for, over its tokens and its prompt."""
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


def check_consistency(
    req: Request,
    answer: list[int],
    greedy: OrderedDict[tuple[int, ...], list[int]],
    tally: dict[str, int],
    canary_out: dict[int, list[int]],
    workload: Workload,
    fail: Fail,
) -> None:
    """Greedy answers to one prompt must agree; every copy of a canary must be identical."""
    if req.kind == "canary":
        canary = id(req)  # every copy is the same Request object
        if canary_out.setdefault(canary, answer) != answer:
            fail(f"canary {workload.canaries.index(req)} changed: {canary_out[canary]} -> {answer}")
        return
    if not req.params.greedy or req.params.stop_token_ids:
        return
    key = (hash(req.salt), *req.prompt)
    before = greedy.pop(key, None)
    if before is not None:
        tally["seen"] += 1
        short, long = sorted((before, answer), key=len)
        if long[: len(short)] != short:
            fail(f"greedy answers to one prompt differ: {before} vs {answer}")
        answer = long
    greedy[key] = answer  # most recent last; keep the harness's own memory bounded
    while len(greedy) > 1000:
        greedy.popitem(last=False)


def final_checks(llm: ServingEngine, rep: SoakReport, tally: dict[str, int], fail: Fail) -> None:
    """Copy the engine's end-of-run counters into `rep`, then check: nothing lost or leaked,
    the pool adds up, and hit/miss/query accounting agrees with what the soak counted."""
    rep.cache = stats = llm.cache_stats()
    rep.preemptions = llm.queue_depth().preemptions
    engine_stats = llm.stats()
    rep.draft_tokens = int(engine_stats["num_draft_tokens"])
    rep.accepted_tokens = int(engine_stats["num_accepted_tokens"])
    if llm.config.record_metrics:  # the rows the recorder keeps (none when it records none)
        metrics = llm.metrics()
        rep.recorder_steps, rep.recorder_requests = len(metrics["steps"]), len(metrics["requests"])
    if rep.finished != rep.requests:
        fail(f"{rep.requests - rep.finished} requests never finished")
    if llm.has_unfinished() or llm.has_live_requests():
        fail("requests are still live after all finished")
    if stats.blocks_in_use != 0:
        fail(f"leak: {stats.blocks_in_use} blocks still in use")
    if stats.blocks_free + stats.blocks_cached != rep.num_blocks:
        fail(f"free {stats.blocks_free} + cached {stats.blocks_cached} != {rep.num_blocks}")
    try:
        llm.check_integrity()
    except AssertionError as err:
        fail(f"final integrity: {err}")
    if stats.query_tokens != rep.prompt_tokens:
        fail(f"query tokens {stats.query_tokens} != prompt tokens submitted {rep.prompt_tokens}")
    if stats.hit_tokens != tally["cached"]:
        fail(f"hit tokens {stats.hit_tokens} != sum of num_cached_tokens {tally['cached']}")
    if stats.hit_tokens + rep.miss_tokens != stats.query_tokens:
        fail(f"hit {stats.hit_tokens} + miss {rep.miss_tokens} != query {stats.query_tokens}")
    if tally["wrong_start"]:
        fail(f"{tally['wrong_start']} requests were computed from another offset than their hit")
    if stats.readmit_hit_tokens > stats.readmit_query_tokens:
        fail("readmission hits exceed readmission queries")


class ReferenceCheck:
    """With speculative decoding on, every greedy or seeded answer is kept and, 64 at a time,
    compared with what an engine that guesses nothing answers to the same request (a seeded
    request samples the same with guesses or without: runner/engine/step/speculative.py)."""

    def __init__(self, reference: ServingEngine) -> None:
        self.reference = reference
        self.pending: list[tuple[Request, list[int]]] = []

    def add(self, req: Request, answer: list[int]) -> None:
        if req.params.greedy or req.params.seed is not None:
            self.pending.append((req, answer))

    def flush(self, rep: SoakReport, fail: Fail, at_least: int = 64) -> None:
        if len(self.pending) < at_least:
            return
        prompts = [req.prompt for req, _ in self.pending]
        outs = self.reference.generate(prompts, [req.params for req, _ in self.pending])
        for (req, answer), out in zip(self.pending, outs, strict=True):
            if out.token_ids != answer:
                fail(f"{req.kind} request: {answer} with guesses, {out.token_ids} without")
        rep.reference_checked += len(self.pending)
        self.pending.clear()
