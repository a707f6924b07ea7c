"""`kvcache bench-serve`: the command, and its report (vLLM's `bench serve` layout)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
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


@click.command("bench-serve")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True)
@click.option(
    "--workload",
    type=click.Choice(["multi-turn", "dataset"]),
    default="multi-turn",
    show_default=True,
    help="multi-turn: chat sessions that open with the dataset's lines and go on with "
    "follow-ups, each turn carrying the answers so far; dataset: the lines, one request each.",
)
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False),
    default="data/no_sharing.jsonl",
    show_default=True,
)
@click.option(
    "--num-prompts",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="dataset: requests; multi-turn: sessions.",
)
@click.option("--turns", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-concurrency", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--request-rate",
    type=float,
    default=float("inf"),
    show_default=True,
    help="Sessions (or requests) started per second, Poisson; inf: all at once.",
)
@click.option("--ignore-eos", is_flag=True, help="Every answer is --max-tokens long.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--result-json", type=click.Path(dir_okay=False), default=None)
def bench_serve(
    base_url: str,
    workload: str,
    dataset: str,
    num_prompts: int,
    turns: int,
    max_tokens: int,
    max_concurrency: int,
    request_rate: float,
    ignore_eos: bool,
    seed: int,
    result_json: str | None,
) -> None:
    """Benchmark an OpenAI-compatible server (kvcache serve or router) with streaming chat
    requests: TTFT / ITL / end-to-end percentiles, throughput, prefix-cache hit rate."""
    import httpx

    from runner.bench.serve.client import run_benchmark
    from runner.bench.serve.workload import multi_turn_sessions, read_lines, single_requests

    try:
        rows = read_lines(Path(dataset))
        model = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30).json()["data"][0]["id"]
    except (ValueError, httpx.HTTPError) as err:
        raise click.ClickException(str(err)) from err
    if workload == "multi-turn":
        sessions = multi_turn_sessions(rows, num_prompts, turns, max_tokens, seed)
    else:
        sessions = single_requests(rows, num_prompts, max_tokens)
    extra = {"ignore_eos": True} if ignore_eos else {}
    before = replica_counts(base_url)
    results, duration = asyncio.run(
        run_benchmark(base_url, model, sessions, max_concurrency, request_rate, seed, extra)
    )
    after = replica_counts(base_url)
    spread = None
    if before is not None and after is not None:
        spread = [a - b for a, b in zip(after, before, strict=True)]
    summary = summarise(results, duration, spread)
    summary |= {"workload": workload, "dataset": dataset, "base_url": base_url}
    print_report(summary)
    if result_json:
        Path(result_json).write_text(json.dumps(summary, indent=2))
