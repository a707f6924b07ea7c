"""bench-serve's summary of one run (vLLM's `bench serve` figures, plus the hit rate and the
spread over a router's replicas) and its printed report.

The summary holds vLLM's result keys (`completed`, `duration`, `total_input_tokens`,
`total_token_throughput`, `mean_/median_/std_/p99_` of `ttft`, `tpot`, `itl` and `e2el` in
milliseconds, the per-request lists `input_lens`, `output_lens`, `ttfts`, `itls`, `latencies`),
so that its JSON sits beside `vllm bench serve --save-result`'s, and ours beside them
(`successful`, `duration_s`, `p50_`/`p90_` percentiles, `*_e2e_ms`, the hit rate). One key
differs in meaning: our `errors` is the first five distinct error texts, not one per request."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, TypeAlias

import click

if TYPE_CHECKING:
    from bench.serve.client import RequestResult

PERCENTILES = (50, 90, 99)
# A run's summary as JSON (the keys above; the series' statistics are named from the series).
Summary: TypeAlias = dict[str, object]


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile, by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(results: list[RequestResult], duration: float, spread: list[int] | None) -> Summary:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    per_s = 1 / duration if duration else 0.0
    summary: Summary = {
        "requests": len(results),
        "successful": len(ok),
        "completed": len(ok),  # vLLM's name
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "duration": duration,  # vLLM's name
        "request_throughput": len(ok) * per_s,
        "output_throughput": output * per_s,
        "total_token_throughput": (prompt + output) * per_s,
        "prompt_tokens": prompt,
        "total_input_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "total_output_tokens": output,
        "hit_rate": cached / prompt if prompt else 0.0,
        # vLLM's per-request lists (seconds), successful requests only
        "input_lens": [r.prompt_tokens for r in ok],
        "output_lens": [r.completion_tokens for r in ok],
        "ttfts": [r.ttft for r in ok],
        "itls": [r.itls for r in ok],
        "latencies": [r.e2e for r in ok],
    }
    e2e = [r.e2e * 1000 for r in ok]
    series = {
        "ttft_ms": [r.ttft * 1000 for r in ok if r.ttft is not None],
        "tpot_ms": [r.tpot * 1000 for r in ok if r.tpot is not None],
        "itl_ms": [gap * 1000 for r in ok for gap in r.itls],
        "e2e_ms": e2e,
        "e2el_ms": e2e,  # vLLM's name of the end-to-end latency
    }
    for name, values in series.items():
        summary[f"mean_{name}"] = statistics.fmean(values) if values else float("nan")
        summary[f"median_{name}"] = percentile(values, 50)
        summary[f"std_{name}"] = statistics.pstdev(values) if values else float("nan")
        for p in PERCENTILES:
            summary[f"p{p}_{name}"] = percentile(values, p)
    if spread is not None:
        summary["requests_per_replica"] = spread
        total = sum(spread)
        summary["largest_replica_share"] = max(spread) / total if total else 0.0
    return summary


def print_report(summary: Summary) -> None:
    line = "{:<40}{:>12}"
    click.echo("{:=^52}".format(" Serving Benchmark Result "))
    rows = [
        ("Successful requests:", summary["successful"]),
        ("Failed requests:", summary["failed"]),
        ("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
        ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{summary['output_throughput']:.1f}"),
        ("Prompt tokens:", summary["prompt_tokens"]),
        ("Cached prompt tokens:", summary["cached_tokens"]),
        ("Prefix cache hit rate:", f"{summary['hit_rate']:.3f}"),
    ]
    if "model_hit_rate_ceiling" in summary:
        rows.append(
            ("Hit rate ceiling (sticky sessions):", f"{summary['model_hit_rate_ceiling']:.3f}")
        )
        rows.append(
            ("Hit rate model, round robin:", f"{summary['model_hit_rate_round_robin']:.3f}")
        )
    if "requests_per_replica" in summary:
        rows.append(("Requests per replica:", str(summary["requests_per_replica"])))
        rows.append(("Largest replica share:", f"{summary['largest_replica_share']:.3f}"))
    for label, value in rows:
        click.echo(line.format(label, value))
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2e", "End-to-end Latency"),
    ):
        click.echo(f"{title:-^52}")
        click.echo(line.format(f"Mean {name.upper()} (ms):", f"{summary[f'mean_{name}_ms']:.2f}"))
        median = f"{summary[f'median_{name}_ms']:.2f}"
        click.echo(line.format(f"Median {name.upper()} (ms):", median))
        for p in PERCENTILES:
            value = f"{summary[f'p{p}_{name}_ms']:.2f}"
            click.echo(line.format(f"P{p} {name.upper()} (ms):", value))
    click.echo("=" * 52)
    errors = summary["errors"]
    assert isinstance(errors, list)  # summarise's first five error texts
    for error in errors:
        click.echo(f"error: {error}", err=True)


def replica_counts(base_url: str, headers: dict[str, str] | None = None) -> list[int] | None:
    """Requests each replica got so far, when `base_url` is a kvcache router."""
    import httpx

    try:
        resp = httpx.get(f"{base_url.rstrip('/')}/router/stats", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return [int(r["sent"]) for r in resp.json()["replicas"]]
