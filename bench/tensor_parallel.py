"""`kvcache bench --workload tensor-parallel`: tensor-parallel ranks against one, on this
machine, in one run: prefill and decode tokens a second, and each rank's weights as held.

Prefill: prompts of about 480 tokens, one output token each, nothing cached (a salt
each). Decode: a batch of short prompts answered with `DECODE_TOKENS` tokens; its rate is the
output tokens over the time after the first token. The same prompts, the same greedy tokens
(checked) at every size."""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

from kvcache import LLM, SamplingParams

PROMPT_WORDS = 400  # about 480 tokens
WORDS = (
    "the cache keeps every block of keys and values that a prompt shares with another one so "
    "only the new part of each request is computed again while the rest is read from memory"
).split()
DECODE_PROMPTS = 8
DECODE_TOKENS = 48


@dataclass
class SizeFigures:
    tensor_parallel_size: int
    prefill_tok_s: float
    decode_tok_s: float
    weight_bytes: list[int]  # each rank's
    weight_ratio: float  # the largest rank's against one rank's whole model


def measure(model: str | None, size: int, whole: int | None) -> tuple[SizeFigures, list[list[int]]]:
    llm = LLM(model, tensor_parallel_size=size, max_model_len=1024)
    rng = random.Random(0)
    long = [" ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS)) for _ in range(6)]
    short = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(DECODE_PROMPTS)]
    llm.generate([short[0]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    one = SamplingParams(max_tokens=1, temperature=0)
    started = time.perf_counter()
    tokens = 0
    for i, prompt in enumerate(long):
        tokens += len(llm.generate([prompt], one, cache_salt=f"prefill-{i}")[0].prompt_token_ids)
    prefill = tokens / (time.perf_counter() - started)
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(short, params, cache_salt="decode")
    first = max(o.metrics["first_token_time_s"] or 0.0 for o in outs) - min(
        o.metrics["arrival_time_s"] for o in outs
    )
    elapsed = time.perf_counter() - started
    decode = DECODE_PROMPTS * (DECODE_TOKENS - 1) / max(1e-9, elapsed - first)
    weights = llm.rank_weight_bytes()
    llm.shutdown()
    base = whole if whole is not None else weights[0]
    figures = SizeFigures(size, prefill, decode, weights, max(weights) / base)
    return figures, [o.outputs[0].token_ids for o in outs]


def tensor_parallel_bench(model: str | None, sizes: tuple[int, ...] = (1, 2)) -> list[dict]:
    """One row a size; the greedy tokens of every size must equal the first's."""
    rows: list[SizeFigures] = []
    want: list[list[int]] | None = None
    for size in sizes:
        figures, tokens = measure(model, size, rows[0].weight_bytes[0] if rows else None)
        if want is not None and tokens != want:
            raise AssertionError(f"tensor_parallel_size={size}: greedy tokens differ from size 1")
        want = want or tokens
        rows.append(figures)
    return [asdict(row) for row in rows]


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        "| ranks | prefill tok/s | decode tok/s | weights per rank (MB) | largest rank vs one |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        mb = ", ".join(f"{b / 2**20:.0f}" for b in row["weight_bytes"])
        lines.append(
            f"| {row['tensor_parallel_size']} | {row['prefill_tok_s']:.0f} "
            f"({row['prefill_tok_s'] / base['prefill_tok_s']:.2f}x) | {row['decode_tok_s']:.1f} "
            f"({row['decode_tok_s'] / base['decode_tok_s']:.2f}x) | {mb} | "
            f"{row['weight_ratio']:.2f}x |"
        )
    return "\n".join(lines)
