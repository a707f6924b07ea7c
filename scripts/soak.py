"""Soak test: many requests of a mixed workload through one LLM with a small KV pool.

    python scripts/soak.py --requests 10000            # tiny random Llama, built on the fly
    python scripts/soak.py --requests 2000 --model DIR

The workload mixes shared system prompts, unique prompts, exact repeats, multi-turn follow-ups
(previous prompt + its answer + more), two salts, greedy and sampled (half seeded) requests,
stop tokens and max_tokens 1..8. Requests are fed as a stream (at most --inflight live), and the
engine loop is driven by hand so the block manager can be checked after every step.

Checked (a failed check is printed and the exit code is 1):
  * every request finishes exactly once, and each finishes for a stated reason;
  * no leak: when all are done no block is in use, free + cached == pool, no live request,
    and `check_integrity()` holds after every --check-every steps and at the end;
  * accounting: query tokens == prompt tokens submitted, hit tokens == sum of the outputs'
    num_cached_tokens, and hit + miss == query, where miss is counted from what the model was
    actually fed during each request's first admission;
  * consistency: greedy answers to the same prompt agree (one is a prefix of the other), and
    every copy of each fixed "canary" request (one greedy, one seeded-sampled) is identical;
  * memory: resident memory (RSS) grows less than --max-rss-growth from the end of the first
    --chunk requests to the end of the last.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 320
SALTS = [None] * 17 + ["tenant-a"] * 2 + ["tenant-b"]  # 15% of requests carry a salt


def build_tiny_llama(path: Path) -> Path:
    """A seeded random 2-layer Llama (hidden 64, vocab 320, context 512) saved as a HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@dataclass
class Request:
    kind: str
    prompt: list[int]
    params: Any  # SamplingParams
    salt: str | None


class Workload:
    """Deterministic stream of mixed requests; `feedback` turns answers into follow-ups."""

    def __init__(self, seed: int, max_prompt: int) -> None:
        from runner.sampling import SamplingParams

        self.SamplingParams = SamplingParams
        self.rng = random.Random(seed)
        self.max_prompt = max_prompt
        self.systems = [self._tokens(n) for n in (8, 13, 16, 24, 31, 40)]
        self.recent: deque[tuple[list[int], str | None]] = deque(maxlen=200)
        self.turns: deque[tuple[list[int], str | None]] = deque(maxlen=50)
        self.canaries = [
            Request("canary", self._tokens(21), SamplingParams(max_tokens=8, temperature=0), None),
            Request(
                "canary",
                self._tokens(27),
                SamplingParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.9, seed=777),
                None,
            ),
        ]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def _params(self) -> Any:
        r = self.rng
        kwargs: dict[str, Any] = {"max_tokens": r.randint(1, 8)}
        if r.random() < 0.3:
            kwargs.update(temperature=r.choice([0.7, 1.0, 1.2]), top_k=r.choice([-1, 20]))
            kwargs["top_p"] = r.choice([1.0, 0.9])
            if r.random() < 0.5:
                kwargs["seed"] = r.randrange(1000)
        else:
            kwargs["temperature"] = 0.0
        if r.random() < 0.1:
            kwargs["stop_token_ids"] = [r.randrange(3, VOCAB)]
        return self.SamplingParams(**kwargs)

    def next(self, index: int) -> Request:
        r = self.rng
        if index % 50 == 25:
            return self.canaries[(index // 50) % 2]
        roll = r.random()
        salt = r.choice(SALTS)
        if roll < 0.45:
            prompt = r.choice(self.systems) + self._tokens(r.randint(1, 12))
            kind = "shared"
        elif roll < 0.65:
            prompt, kind = self._tokens(r.randint(4, 40)), "unique"
        elif roll < 0.85 and self.recent:
            (prompt, salt), kind = r.choice(self.recent), "repeat"
        elif self.turns:
            prev, salt = self.turns[r.randrange(len(self.turns))]
            prompt, kind = prev + self._tokens(r.randint(2, 8)), "turn"
            if len(prompt) > self.max_prompt:
                prompt, kind = r.choice(self.systems) + self._tokens(3), "shared"
        else:
            prompt, kind = self._tokens(r.randint(4, 40)), "unique"
        self.recent.append((prompt, salt))
        return Request(kind, list(prompt), self._params(), salt)

    def feedback(self, prompt: list[int], answer: list[int], salt: str | None) -> None:
        if len(prompt) + len(answer) <= self.max_prompt - 8:
            self.turns.append((prompt + answer, salt))


@dataclass
class SoakReport:
    requests: int = 0
    finished: int = 0
    steps: int = 0
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    prompt_tokens: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    readmit_query_tokens: int = 0
    readmit_hit_tokens: int = 0
    evicted_blocks: int = 0
    preemptions: int = 0
    num_blocks: int = 0
    blocks_in_use: int = 0
    greedy_prompts_compared: int = 0
    canary_copies: int = 0
    rss_mb: list[float] = field(default_factory=list)  # after each chunk of finished requests
    recorder_steps: int = 0
    recorder_requests: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        if len(self.rss_mb) < 2:
            return 0.0
        return (self.rss_mb[-1] - self.rss_mb[0]) / self.rss_mb[0]

    def table(self) -> str:
        hit_rate = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        rows = [
            ("requests finished", f"{self.finished} / {self.requests}"),
            ("kinds", ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items()))),
            ("engine steps", f"{self.steps}"),
            ("wall time", f"{self.seconds:.1f} s ({self.requests / self.seconds:.0f} req/s)"),
            ("output tokens", f"{self.output_tokens}"),
            ("query tokens", f"{self.query_tokens} (prompts submitted: {self.prompt_tokens})"),
            ("hit + miss tokens", f"{self.hit_tokens} + {self.miss_tokens} ({hit_rate:.1%} hit)"),
            ("readmission q/hit", f"{self.readmit_query_tokens} / {self.readmit_hit_tokens}"),
            ("preemptions", f"{self.preemptions}"),
            ("evicted blocks", f"{self.evicted_blocks}"),
            ("blocks in use at end", f"{self.blocks_in_use} of {self.num_blocks}"),
            ("greedy prompts seen 2+ times", f"{self.greedy_prompts_compared}"),
            ("canary copies", f"{self.canary_copies}"),
            (
                "metrics rows kept",
                f"{self.recorder_steps} steps, {self.recorder_requests} requests",
            ),
            ("RSS per chunk (MB)", " ".join(f"{m:.0f}" for m in self.rss_mb)),
            ("RSS growth", f"{self.rss_growth:+.1%} (first chunk end -> last chunk end)"),
            ("result", "PASS" if not self.failures else f"FAIL ({len(self.failures)})"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        lines += [f"  failure: {f}" for f in self.failures]
        return "\n".join(lines)


class FirstAdmissionCounter:
    """Wraps `scheduler.schedule` to count the prompt tokens the model is fed while each
    request is in its first admission (before any preemption): the real cache misses."""

    def __init__(self, scheduler: Any) -> None:
        self.fed: dict[int, int] = {}
        self.first_start: dict[int, int] = {}
        self._schedule = scheduler.schedule
        scheduler.schedule = self

    def __call__(self) -> Any:
        out = self._schedule()
        for item in out.scheduled:
            seq = item.seq
            if seq.num_preemptions or item.start >= seq.num_prompt_tokens:
                continue
            self.first_start.setdefault(seq.seq_id, item.start)
            end = min(item.start + item.num_new_tokens, seq.num_prompt_tokens)
            self.fed[seq.seq_id] = self.fed.get(seq.seq_id, 0) + end - item.start
        return out

    def misses(self, seq: Any, tally: dict[str, int]) -> int:
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


def _rss_mb() -> float:
    gc.collect()
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
    record_steps: bool = True,
    batching: str = "continuous",
    max_num_batched_tokens: int = 2048,
) -> SoakReport:
    from runner.engine import LLM

    max_prompt = num_kv_blocks * block_size // 2 - 8
    llm = LLM(
        model,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        seed=seed,
        batching=batching,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    llm.recorder.record_steps = record_steps
    counter = FirstAdmissionCounter(llm.scheduler)
    workload = Workload(seed, max_prompt=min(max_prompt, 80))
    rep = SoakReport(requests=requests, num_blocks=num_kv_blocks)
    live: dict[str, tuple[Request, Any]] = {}
    greedy: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()  # bounded: see _remember
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
                llm.block_manager.check_integrity()
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
            rep.output_tokens += len(out.token_ids)
            tally["cached"] += out.num_cached_tokens
            rep.miss_tokens += counter.misses(seq, tally)
            workload.feedback(req.prompt, out.token_ids, req.salt)
            _check_consistency(req, out.token_ids, greedy, tally, canary_out, workload, fail)
            if rep.finished % chunk == 0:
                rep.rss_mb.append(_rss_mb())
    rep.seconds = time.perf_counter() - start
    rep.greedy_prompts_compared = tally["seen"]
    rep.canary_copies = rep.kinds.get("canary", 0)
    _final_checks(llm, rep, tally, fail)
    if max_rss_growth is not None and len(rep.rss_mb) >= 2 and rep.rss_growth > max_rss_growth:
        fail(f"RSS grew {rep.rss_growth:.1%} (> {max_rss_growth:.0%}): {rep.rss_mb}")
    return rep


def _check_consistency(
    req: Request,
    answer: list[int],
    greedy: OrderedDict[tuple[int, ...], list[int]],
    tally: dict[str, int],
    canary_out: dict[int, list[int]],
    workload: Workload,
    fail: Any,
) -> None:
    """Greedy answers to one prompt must agree; every copy of a canary must be identical."""
    if req.kind == "canary":
        key = id(req)
        if canary_out.setdefault(key, answer) != answer:
            fail(f"canary {workload.canaries.index(req)} changed: {canary_out[key]} -> {answer}")
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


def _final_checks(llm: Any, rep: SoakReport, tally: dict[str, int], fail: Any) -> None:
    stats = llm.block_manager.stats
    rep.query_tokens, rep.hit_tokens = stats.query_tokens, stats.hit_tokens
    rep.readmit_query_tokens = stats.readmit_query_tokens
    rep.readmit_hit_tokens = stats.readmit_hit_tokens
    rep.evicted_blocks, rep.blocks_in_use = stats.evicted_blocks, stats.blocks_in_use
    rep.preemptions = llm.scheduler.num_preemptions
    rep.recorder_steps = len(llm.recorder.steps)
    rep.recorder_requests = len(llm.recorder.requests)
    if rep.finished != rep.requests:
        fail(f"{rep.requests - rep.finished} requests never finished")
    if llm.has_unfinished() or llm._live:
        fail("requests are still live after all finished")
    if stats.blocks_in_use != 0:
        fail(f"leak: {stats.blocks_in_use} blocks still in use")
    if stats.blocks_free + stats.blocks_cached != rep.num_blocks:
        fail(f"free {stats.blocks_free} + cached {stats.blocks_cached} != {rep.num_blocks}")
    try:
        llm.block_manager.check_integrity()
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


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--model", help="HF model folder (default: a tiny random Llama)")
    p.add_argument("--num-kv-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument(
        "--inflight", type=int, default=32, help="most requests live at once (0: all at once)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=1000, help="requests per RSS sample")
    p.add_argument("--check-every", type=int, default=1, help="steps between integrity checks")
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step budget")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny model: 1)")
    p.add_argument(
        "--no-record-steps", action="store_true", help="turn off the per-step metrics rows"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvcache-soak-") as tmp:
        model = args.model or str(build_tiny_llama(Path(tmp) / "tiny-llama"))
        rep = run_soak(
            model,
            args.requests,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            inflight=args.inflight,
            seed=args.seed,
            chunk=args.chunk,
            check_every=args.check_every,
            max_rss_growth=args.max_rss_growth,
            record_steps=not args.no_record_steps,
            batching=args.batching,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    print(rep.table())
    return 0 if not rep.failures else 1


if __name__ == "__main__":
    sys.exit(main())
