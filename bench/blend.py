"""`kvcache bench --workload blend`: what reuse beyond the prefix costs in accuracy and saves in
time, on the blend workload (bench/blend_workload.py), with one engine.

Three measurements:

* accuracy and time, per blend ratio, with every passage cached alone (each query's passages
  are cached just before it is measured): each query is answered
  by full prefill (a cache salt of its own: nothing cached), by the engine at each ratio, and
  with prefix caching alone (ratio 1: the system prompt cached, the passages computed). The
  first 32 greedy tokens are compared with full prefill's (the first token, and how many of
  the 32 are equal), time to first token is the engine's own (`ttft_s`).
* the mean KL divergence of the next-token distributions along full prefill's answer (33
  positions: the first token and the 32 after it, teacher-forced), and the projections' work
  (token-layer rows) against full prefill's: the same functions the engine blends with
  (runner/model/blend.py) on the engine's model, over a scratch KV store of their own.
* hit rates over a long stream of queries (one new token each), the first 100 beside the
  last 100: whether reuse holds up under novel traffic.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.blend_workload import Query, passages, queries
from kvcache import LLM, RequestOutput, SamplingParams
from runner.engine.api.interface import ForwardParts
from runner.kv_pool.store import KVStore
from runner.model.blend import Cached, blend, compute_chunk, layout, place

RATIOS = (0.0, 0.05, 0.15, 0.2, 0.3, 1.0)
ANSWER_TOKENS = 32
FIRST, LAST = 100, 100  # the stream's queries compared: its first and its last


@dataclass
class RatioFigures:
    """One blend ratio's figures over the accuracy queries."""

    first_token: list[bool]
    equal_tokens: list[int]
    ttft_s: list[float]
    kl: list[float]
    rows: list[float]  # token-layer rows computed, as a fraction of full prefill's

    def as_row(self, ratio: float | str, full_ttft: float) -> dict[str, float | str]:
        ttft = statistics.mean(self.ttft_s)
        return {
            "ratio": ratio,
            "first_token_agreement": statistics.mean(self.first_token),
            "equal_of_32": statistics.mean(self.equal_tokens),
            "mean_kl_nats": statistics.mean(self.kl) if self.kl else 0.0,
            "ttft_s": ttft,
            "ttft_vs_full": ttft / full_ttft,
            "prefill_rows_vs_full": statistics.mean(self.rows) if self.rows else 1.0,
        }


def blend_bench(
    model: str | None, accuracy_queries: int, stream_queries: int, seed: int = 0
) -> dict[str, object]:
    """Every figure of the module's three measurements, with the table's rows."""
    llm = LLM(model)
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise ValueError("the blend workload is text: this model has no tokenizer")
    docs = passages(tokenizer)
    asked = queries(tokenizer, docs, accuracy_queries, seed)
    accuracy = measure_accuracy(llm, asked)
    stream = measure_stream(model, queries(tokenizer, docs, stream_queries, seed + 1))
    return {"passages": len(docs), "accuracy": accuracy, "stream": stream}


def warm(llm: LLM, asked: Sequence[Query]) -> None:
    """Cache every passage of the queries alone: each seen twice after openings no query
    has (a passage is cached alone from its second sighting)."""
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    one = SamplingParams(max_tokens=1, temperature=0)
    for variant in ("Passages follow.", "Read these passages."):
        opening = tokenizer(variant, add_special_tokens=True).input_ids
        for q in asked:
            prompt = {"segments": [opening, *q.segments[1:]], "blend_ratio": 0.0}
            llm.generate(prompt, one)


def measure_accuracy(llm: LLM, asked: Sequence[Query]) -> list[dict[str, float | str]]:
    """Per ratio (and full prefill, and prefix caching alone): the table's rows."""
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0)
    probe = BlendProbe(llm.forward_parts(), llm.config.block_size)
    figures = {r: RatioFigures([], [], [], [], []) for r in (*RATIOS[:-1], "full", "prefix-only")}
    for i, q in enumerate(asked):
        warm(llm, [q])  # its passages cached alone now: the pool holds fewer than all queries'
        full = llm.generate(
            {"segments": q.segments, "blend_ratio": 1.0}, params, cache_salt=f"cold-{i}"
        )[0]
        answer = full.token_ids
        record(figures["full"], full, answer)
        reference = probe.distributions(q, answer, None)
        for ratio in RATIOS[:-1]:
            out = llm.generate({"segments": q.segments, "blend_ratio": ratio}, params)[0]
            record(figures[ratio], out, answer)
            dists, rows = probe.distributions(q, answer, ratio)
            figures[ratio].kl.append(mean_kl(reference[0], dists))
            figures[ratio].rows.append(rows / reference[1])
        prefix_only = llm.generate({"segments": q.segments, "blend_ratio": 1.0}, params)[0]
        record(figures["prefix-only"], prefix_only, answer)  # ratio 1: the plain engine
    full_ttft = statistics.mean(figures["full"].ttft_s)
    return [figures[key].as_row(key, full_ttft) for key in ("full", "prefix-only", *RATIOS[:-1])]


def record(figures: RatioFigures, out: RequestOutput, answer: list[int]) -> None:
    tokens = out.token_ids
    figures.first_token.append(bool(tokens) and bool(answer) and tokens[0] == answer[0])
    figures.equal_tokens.append(sum(a == b for a, b in zip(tokens, answer, strict=False)))
    figures.ttft_s.append(float(out.metrics["ttft_s"]))


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other), in nats; both [P, vocab] log-probs."""
    kl = (reference.exp() * (reference - other)).sum(-1)
    return float(kl.mean())


def measure_stream(model: str | None, stream: Sequence[Query]) -> dict[str, float | int]:
    """A long stream through a fresh engine at its default ratio: segment and prefix hit
    rates of the first and the last queries."""
    llm = LLM(model)
    one = SamplingParams(max_tokens=1, temperature=0)
    reused, passage_tokens, cached, prompt_tokens = [], [], [], []
    started = time.perf_counter()
    for q in stream:
        out = llm.generate({"segments": q.segments}, one)[0]
        reused.append(out.num_reused_segment_tokens)
        passage_tokens.append(sum(len(s) for s in q.segments[1:-1]))
        cached.append(out.num_cached_tokens)
        prompt_tokens.append(len(out.prompt_token_ids))
    n = len(stream)
    first, last = slice(0, min(FIRST, n)), slice(max(0, n - LAST), n)

    def rate(hit: list[int], total: list[int], part: slice) -> float:
        return sum(hit[part]) / max(1, sum(total[part]))

    stats = llm.stats()
    return {
        "queries": n,
        "seconds": time.perf_counter() - started,
        "segment_hit_rate_first": rate(reused, passage_tokens, first),
        "segment_hit_rate_last": rate(reused, passage_tokens, last),
        "prefix_hit_rate_first": rate(cached, prompt_tokens, first),
        "prefix_hit_rate_last": rate(cached, prompt_tokens, last),
        "segments_filled": int(stats["segments_filled"]),
        "evicted_blocks": int(stats["evicted_blocks"]),
        "num_kv_blocks": int(stats["num_kv_blocks"]),
    }


class BlendProbe:
    """Next-token distributions along an answer, teacher-forced after a prompt computed in
    full or blended at a ratio: the engine's model and blend functions over a scratch store."""

    def __init__(self, parts: ForwardParts, block_size: int) -> None:
        self.model, self.attention = parts.model, parts.attention
        self.block_size = block_size
        self.kv: KVStore | None = None

    def distributions(
        self, q: Query, answer: list[int], ratio: float | None
    ) -> tuple[torch.Tensor, int]:
        """log-probs [1 + len(answer), vocab] at the prompt's last position and along the
        answer, and the token-layer rows the prompt's K/V took (ratio None: full prefill)."""
        tokens = [t for s in q.segments for t in s]
        total = len(tokens) + len(answer)
        bs, model = self.block_size, self.model
        blocks = -(-total // bs)
        alone = sum(-(-len(s) // bs) for s in q.segments[1:-1])
        kv = self.store(blocks + alone + 1)
        table = list(range(1, blocks + 1))
        layers = model.num_layers
        with torch.inference_mode():
            if ratio is None:
                hidden = self.forward(tokens + answer, 0, table, kv)
                rows = layers * len(tokens)
            else:
                start = len(q.segments[0])
                end = len(tokens) - len(q.segments[-1])
                self.forward(q.segments[0], 0, table, kv)
                cached, free, position = [], blocks + 1, start
                for segment in q.segments[1:-1]:
                    own = list(range(free, free + -(-len(segment) // bs)))
                    free += len(own)
                    self.forward(segment, 0, own, kv)
                    full = len(segment) // bs * bs  # as the engine: full blocks reused
                    cached.append(Cached(position, full, own))
                    position += len(segment)
                placement, region = layout(tokens, start, end, cached, table, bs)
                place(model, kv, placement)
                recomputed = blend(model, kv, self.attention, region, ratio)
                forced = region.reused.count(False)
                deep = recomputed + forced if ratio > 0 else forced
                selected_at = min(2, layers) if ratio > 0 else 0
                rows = layers * (start + len(tokens) - end)
                rows += selected_at * (end - start) + (layers - selected_at) * deep
                hidden = self.forward(tokens[end:] + answer, end, table, kv)
                hidden = torch.cat((hidden.new_zeros(end, hidden.shape[1]), hidden))
            last = len(tokens) - 1
            logits = model.compute_logits(hidden[last : last + 1 + len(answer)])
        return torch.log_softmax(logits, dim=-1), rows

    def forward(self, tokens: list[int], start: int, table: list[int], kv: KVStore) -> torch.Tensor:
        return compute_chunk(self.model, kv, self.attention, tokens, start, table)

    def store(self, blocks: int) -> KVStore:
        """A scratch store of at least `blocks` blocks (grown when a query needs more)."""
        if self.kv is None or self.kv.num_blocks < blocks:
            m = self.model
            weights = m.embed_tokens.weight
            self.kv = KVStore(
                m.num_layers,
                blocks,
                self.block_size,
                m.num_kv_heads,
                m.head_dim,
                weights.dtype,
                weights.device,
            )
        return self.kv


def table(result: dict[str, object]) -> str:
    """The accuracy rows and the stream's hit rates as text."""
    rows = result["accuracy"]
    assert isinstance(rows, list)
    lines = [
        f"{'ratio':>12} {'1st token':>9} {'=of 32':>7} {'KL nats':>8} {'TTFT s':>7} "
        f"{'vs full':>7} {'rows':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r['ratio']!s:>12} {r['first_token_agreement']:>9.1%} {r['equal_of_32']:>7.1f} "
            f"{r['mean_kl_nats']:>8.4f} {r['ttft_s']:>7.3f} {r['ttft_vs_full']:>7.2f} "
            f"{r['prefill_rows_vs_full']:>6.2f}"
        )
    stream = result["stream"]
    assert isinstance(stream, dict)
    lines.append(
        f"stream of {stream['queries']} queries ({stream['seconds']:.0f} s): segment hit rate "
        f"first {FIRST} {stream['segment_hit_rate_first']:.1%}, last {LAST} "
        f"{stream['segment_hit_rate_last']:.1%}; prefix hit rate "
        f"{stream['prefix_hit_rate_first']:.1%} -> {stream['prefix_hit_rate_last']:.1%}; "
        f"{stream['segments_filled']} passages cached alone, {stream['evicted_blocks']} blocks "
        f"evicted of {stream['num_kv_blocks']}"
    )
    return "\n".join(lines)
