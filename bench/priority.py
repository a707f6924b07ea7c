"""`kvcache bench --workload priority`: what priority scheduling buys an urgent request, in one
run. A queue of background requests (priority 10) is running when a few urgent ones
(priority 0) arrive; at most `MAX_NUM_SEQS` run at once. Under continuous batching (first
come, first served) the urgent requests wait behind the whole queue; under priority scheduling
they are admitted at the next free slot. The figures: each class's latency from the urgent
requests' arrival to its answer (median and worst), and the time until every request is done.
The same greedy tokens under both (checked): the order changes, the answers do not."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from kvcache import LLM, SamplingParams

BACKGROUND = 32
URGENT = 4
MAX_NUM_SEQS = 4
STEPS_BEFORE_URGENT = 3  # the background queue is running when the urgent requests come
MAX_TOKENS = 32


@dataclass
class PolicyFigures:
    batching: str
    urgent_median_s: float
    urgent_max_s: float
    background_median_s: float
    all_done_s: float


def measure(
    model: str | None, batching: str, background: int
) -> tuple[PolicyFigures, dict[str, list[int]]]:
    """One policy's figures, and every request's greedy tokens by id."""
    llm = LLM(model, max_num_seqs=MAX_NUM_SEQS, batching=batching)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(["Warm-up."], SamplingParams(max_tokens=2, temperature=0))
    for i in range(background):
        prompt = f"Background job {i}: summarise the history of the printing press in detail."
        llm.add_request(prompt, params, request_id=f"background-{i}", priority=10)
    for _ in range(STEPS_BEFORE_URGENT):
        llm.step()
    arrived = time.perf_counter()
    for i in range(URGENT):
        llm.add_request(f"Urgent {i}: what is two plus two?", params, request_id=f"urgent-{i}")
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while llm.has_unfinished():
        for out in llm.step():
            done[out.request_id] = time.perf_counter() - arrived
            tokens[out.request_id] = out.token_ids
    urgent = [t for rid, t in done.items() if rid.startswith("urgent")]
    rest = [t for rid, t in done.items() if rid.startswith("background")]
    median = statistics.median
    figures = PolicyFigures(batching, median(urgent), max(urgent), median(rest), max(done.values()))
    return figures, tokens


def priority_bench(model: str | None, limit: int | None) -> list[dict]:
    """A row for continuous batching and one for priority scheduling; `limit`: background
    requests (default BACKGROUND)."""
    rows: list[dict] = []
    want: dict[str, list[int]] | None = None
    for batching in ("continuous", "priority"):
        figures, tokens = measure(model, batching, limit or BACKGROUND)
        if want is not None and tokens != want:
            raise AssertionError(f"batching={batching!r}: greedy tokens differ from continuous")
        want = want or tokens
        rows.append(asdict(figures))
    return rows


def table(rows: list[dict]) -> str:
    """Latencies in seconds from the urgent requests' arrival; the ratios against the first
    row's (continuous batching)."""
    base = rows[0]
    lines = [
        "| batching | urgent median | urgent worst | background median | all done |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [row["batching"]]
        for key in ("urgent_median_s", "urgent_max_s", "background_median_s", "all_done_s"):
            cells.append(f"{row[key]:.2f} ({row[key] / base[key]:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
