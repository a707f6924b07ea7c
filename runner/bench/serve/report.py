"""bench-serve's summary of one run (vLLM's `bench serve` figures, plus the hit rate and the
spread over a router's replicas) and its printed report."""

from __future__ import annotations

from typing import Any

import click

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile, by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(results: list[Any], duration: float, spread: list[int] | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": len(results),
        "successful": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "hit_rate": cached / prompt if prompt else 0.0,
    }
    series = {
        "ttft_ms": [r.ttft * 1000 for r in ok if r.ttft is not None],
        "itl_ms": [gap * 1000 for r in ok for gap in r.itls],
        "e2e_ms": [r.e2e * 1000 for r in ok],
    }
    for name, values in series.items():
        summary[f"mean_{name}"] = sum(values) / len(values) if values else float("nan")
        for p in PERCENTILES:
            summary[f"p{p}_{name}"] = percentile(values, p)
    if spread is not None:
        summary["requests_per_replica"] = spread
        total = sum(spread)
        summary["largest_replica_share"] = max(spread) / total if total else 0.0
    return summary


def print_report(summary: dict[str, Any]) -> None:
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
        ("itl", "Inter-token Latency"),
        ("e2e", "End-to-end Latency"),
    ):
        click.echo(f"{title:-^52}")
        click.echo(line.format(f"Mean {name.upper()} (ms):", f"{summary[f'mean_{name}_ms']:.2f}"))
        for p in PERCENTILES:
            value = f"{summary[f'p{p}_{name}_ms']:.2f}"
            click.echo(line.format(f"P{p} {name.upper()} (ms):", value))
    click.echo("=" * 52)
    for error in summary["errors"]:
        click.echo(f"error: {error}", err=True)


def replica_counts(base_url: str) -> list[int] | None:
    """Requests each replica got so far, when `base_url` is a kvcache router."""
    import httpx

    try:
        resp = httpx.get(f"{base_url.rstrip('/')}/router/stats", timeout=10)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return [int(r["sent"]) for r in resp.json()["replicas"]]
