"""Two bench-serve summaries side by side: kvcache's server and llama-server, on the same
sessions."""

from __future__ import annotations

import click

from bench.serve.report import Summary

ROWS = (
    ("successful requests", "successful", "{:.0f}"),
    ("prompt tokens", "prompt_tokens", "{:.0f}"),
    ("cached prompt tokens", "cached_tokens", "{:.0f}"),
    ("prefix cache hit rate", "hit_rate", "{:.3f}"),
    ("TTFT p50 (ms)", "p50_ttft_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "{:.1f}"),
    ("ITL mean (ms)", "mean_itl_ms", "{:.1f}"),
    ("ITL p99 (ms)", "p99_itl_ms", "{:.1f}"),
    ("E2E p50 (ms)", "p50_e2e_ms", "{:.1f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("duration (s)", "duration_s", "{:.2f}"),
)


def print_comparison(ours: Summary, theirs: Summary) -> None:
    line = "{:<28}{:>12}{:>14}"
    click.echo("{:=^54}".format(" kvcache vs llama-server "))
    click.echo(line.format("", "kvcache", "llama-server"))
    for label, key, fmt in ROWS:
        click.echo(line.format(label, fmt.format(ours[key]), fmt.format(theirs[key])))
    click.echo("=" * 54)
