"""Read the engine's metrics JSON (schema version 1) and summarise it as text.

Pure functions over the parsed dict, so the CLI, the HTML page and the tests share one set of
numbers: `summary_rows` and `prefix_breakdown` compute, `format_summary` only lays them out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from runner.report.fields import check_fields
from runner.report.metrics_file import MetricsFile, RequestRow
from runner.report.tiers import HEADER, tier_footer, tier_rows
from runner.report.time_split import TIME_HEADER, time_breakdown, time_cells

SCHEMA_VERSION = 1
REQUIRED_KEYS = ("version", "cache", "requests", "steps", "wall_time_s")
NO_PREFIX = "(no full block)"


def load_metrics(path: str | Path) -> MetricsFile:
    """Parse and sanity-check a metrics file; ValueError (never KeyError) says what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"metrics file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read metrics file {path}: {e}") from None
    try:
        metrics = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    validate_metrics(metrics, source=str(path))
    return metrics


def validate_metrics(metrics: object, source: str = "metrics") -> None:
    if not isinstance(metrics, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(metrics).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in metrics]
    if missing:
        raise ValueError(f"{source}: missing keys {', '.join(missing)}")
    if metrics["version"] != SCHEMA_VERSION:
        raise ValueError(
            f"{source}: schema version {metrics['version']!r}, this reader knows {SCHEMA_VERSION}"
        )
    for key, kind in (("cache", dict), ("requests", list), ("steps", list)):
        if not isinstance(metrics[key], kind):
            raise ValueError(f"{source}: '{key}' should be a {kind.__name__}")
    check_fields(metrics, source)  # every field the report reads, by name


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def hit_rate(metrics: MetricsFile) -> float:
    """First-admission hits over first-admission queries, the engine's own counters.

    Readmissions after preemption are counted apart by the engine, so they cannot inflate
    this; a stored `hit_rate` is ignored in favour of recomputing it from the counters.
    """
    cache = metrics["cache"]
    query = cache.get("query_tokens", 0)
    return cache.get("hit_tokens", 0) / query if query else 0.0


def prefill_tokens(metrics: MetricsFile) -> tuple[int, int]:
    """(prefill tokens computed, what the same run would compute with no cache).

    Computed is what the steps fed the model (recomputation after preemption included); every
    token the cache served, first admission or readmission, would otherwise be computed too.
    """
    steps = metrics["steps"]
    if steps:
        computed = sum(s.get("num_prefill_tokens", 0) for s in steps)
    else:  # a run recorded without steps: fall back to the per-request view
        computed = sum(r["prompt_tokens"] - r["cached_tokens"] for r in metrics["requests"])
    cache = metrics["cache"]
    served = cache.get("hit_tokens", 0) + cache.get("readmit_hit_tokens", 0)
    segments = metrics.get("segments") or {}
    served += segments.get("segment_hit_tokens", 0)  # placed, not computed
    filled = segments.get("segment_filled_tokens", 0)  # segments computed alone, to cache them
    return computed + filled, computed + served


def latencies_ms(metrics: MetricsFile) -> tuple[list[float], list[float]]:
    """(TTFT of each request that produced a token, every inter-token gap), in ms."""
    reqs = metrics["requests"]
    ttft = [t * 1000 for r in reqs if (t := r.get("ttft_s")) is not None]
    itl = [x * 1000 for r in reqs for x in r.get("itl_s") or []]
    return ttft, itl


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pcts(values: list[float]) -> str:
    return " / ".join(_fmt_ms(percentile(values, q)) for q in (50, 90, 99))


def _copied(tokens: int) -> str:
    """How many hits were copied from partial blocks (tails), when any were."""
    return f"; {tokens:,} copied from partial blocks" if tokens else ""


def summary_rows(metrics: MetricsFile) -> list[tuple[str, str]]:
    """(label, value) pairs in display order; the text table and the HTML table print these."""
    reqs = metrics["requests"]
    cache = metrics["cache"]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    cached = sum(r["cached_tokens"] for r in reqs)
    output = sum(r["output_tokens"] for r in reqs)
    computed, no_cache = prefill_tokens(metrics)
    saved = 1 - computed / no_cache if no_cache else 0.0
    wall = metrics["wall_time_s"]
    ttft, itl = latencies_ms(metrics)
    finished = sum(1 for r in reqs if r.get("finish_reason") in ("stop", "length"))
    errors = sum(1 for r in reqs if r.get("finish_reason") == "error")
    aborted = sum(1 for r in reqs if r.get("finish_reason") == "abort")
    state = f"{finished} finished, {errors} errors" + (f", {aborted} aborted" if aborted else "")
    rows = [
        # One row per sequence: a request of n samples has n ("<id>#<j>").
        ("requests", f"{len(reqs)} ({state})"),
        ("prompt tokens", f"{prompt:,}"),
        ("cached prompt tokens", f"{cached:,}"),
        (
            "cache hit rate",
            f"{hit_rate(metrics):.1%} ({cache.get('hit_tokens', 0):,} of "
            f"{cache.get('query_tokens', 0):,} query tokens"
            + _copied(cache.get("copied_tokens", 0))
            + ")",
        ),
    ]
    segments = metrics.get("segments") or {}
    if segments.get("segment_query_tokens"):  # prompts given as segments (docs/SEGMENTS.md)
        asked, hit = segments["segment_query_tokens"], segments.get("segment_hit_tokens", 0)
        recomputed = segments.get("segment_recomputed_tokens", 0)
        rows.append(
            (
                "segment hit rate",
                f"{hit / asked:.1%} ({hit:,} of {asked:,} later-segment tokens; "
                f"{recomputed / hit if hit else 0.0:.1%} of them recomputed; "
                f"{segments.get('segments_filled', 0):,} segments cached alone)",
            )
        )
    if cache.get("readmit_query_tokens"):
        rows.append(
            (
                "readmission hits",
                f"{cache.get('readmit_hit_tokens', 0):,} of {cache['readmit_query_tokens']:,}",
            )
        )
    rows += [
        (
            "prefill tokens computed",
            f"{computed:,} vs {no_cache:,} without cache ({saved:.1%} saved)",
        ),
        ("output tokens", f"{output:,}"),
        ("evicted blocks", f"{cache.get('evicted_blocks', 0):,}"),
        ("preemptions", f"{metrics.get('num_preemptions', 0):,}"),
    ]
    drafted = metrics.get("num_draft_tokens", 0)
    if drafted:  # a run with speculative decoding on
        kept = metrics.get("num_accepted_tokens") or 0  # null: none recorded
        rows.append(("guessed tokens kept", f"{kept:,} of {drafted:,} ({kept / drafted:.1%})"))
    rows += [
        ("engine steps", f"{len(metrics['steps']):,}"),
        ("wall time", f"{wall:.2f} s"),
        (
            "throughput",
            f"{output / wall:.1f} output tok/s, {len(reqs) / wall:.2f} req/s" if wall > 0 else "-",
        ),
        ("TTFT p50 / p90 / p99", f"{_pcts(ttft)} ms"),
        ("inter-token p50 / p90 / p99", f"{_pcts(itl)} ms"),
    ]
    return rows


class PrefixGroup(NamedTuple):
    prefix_key: str
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    preview: str

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_breakdown(metrics: MetricsFile) -> list[PrefixGroup]:
    """Requests grouped by the hash of their first full block, most cached tokens first.

    The first block's hash stands for the whole shared prefix: requests whose first blocks
    differ cannot share any block, because block hashes chain through their parents.
    """
    groups: dict[str, list[RequestRow]] = {}
    for r in metrics["requests"]:
        groups.setdefault(r.get("prefix_key") or "", []).append(r)
    out = [
        PrefixGroup(
            prefix_key=key,
            num_requests=len(rs),
            prompt_tokens=sum(r["prompt_tokens"] for r in rs),
            cached_tokens=sum(r["cached_tokens"] for r in rs),
            preview=rs[0].get("prefix_preview") or "",
        )
        for key, rs in groups.items()
    ]
    # Key last: a stable order for ties, so reports of the same run are identical.
    out.sort(key=lambda g: (-g.cached_tokens, -g.num_requests, g.prefix_key))
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _preview(text: str, width: int = 48) -> str:
    flat = " ".join(text.split())  # newlines in a preview would break the table
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def format_summary(metrics: MetricsFile, max_groups: int = 20) -> str:
    """The run's headline numbers, where the steps' time went, then which shared prefixes
    paid off."""
    caching = "on" if metrics.get("enable_prefix_caching", True) else "off"
    title = (
        f"kvcache report: {metrics.get('model', '?')}, {metrics.get('batching', '?')} batching, "
        f"prefix caching {caching}, block size {metrics.get('block_size', '?')}, "
        f"{metrics.get('num_kv_blocks', '?')} KV blocks, "
        f"budget {metrics.get('max_num_batched_tokens', '?')} tokens/step"
    )
    weights = metrics.get("cpu_weight_dtype", "float32")
    if weights != "float32":  # another model than the checkpoint's: say so
        title += f", {weights} weights"
    if metrics.get("kv_cache_dtype", "float32") == "float16":  # rounded keys and values too
        title += ", float16 KV cache"
    lines = [title, ""]
    lines += _table(("metric", "value"), summary_rows(metrics), right=set())
    timing = time_breakdown(metrics["steps"])
    if timing:
        lines += ["", "Where the time went (shares of each kind's wall time):"]
        lines += _table(TIME_HEADER, [time_cells(r) for r in timing], right=set(range(1, 8)))
    tiers = tier_rows(metrics)
    if tiers:
        lines += ["", "Cache tiers (hits served from each; the device pool first):"]
        lines += _table(HEADER, tiers, right=set(range(1, 8))) + [tier_footer(metrics)]
    groups = prefix_breakdown(metrics)
    lines += ["", f"By shared prefix (first full block), {len(groups)} groups:"]
    rows = [
        (
            g.prefix_key[:12] or NO_PREFIX,
            str(g.num_requests),
            f"{g.prompt_tokens:,}",
            f"{g.cached_tokens:,}",
            f"{g.hit_rate:.1%}",
            _preview(g.preview),
        )
        for g in groups[:max_groups]
    ]
    header = ("prefix", "requests", "prompt tok", "cached tok", "hit rate", "preview")
    lines += _table(header, rows, right={1, 2, 3, 4})
    if len(groups) > max_groups:
        lines.append(f"... {len(groups) - max_groups} more groups")
    return "\n".join(lines) + "\n"
