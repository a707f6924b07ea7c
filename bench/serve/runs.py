"""One bench-serve load and the servers it is run against: a kvcache server or router at
--base-url, then, for the comparison, a llama-server started here on the same GGUF."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NamedTuple

import click

from bench.serve.report import Summary, print_report, replica_counts, summarise
from bench.serve.workload import Session


class Load(NamedTuple):
    """What every server of one bench run is sent, and how."""

    sessions: list[Session]
    max_concurrency: int
    request_rate: float
    seed: int
    ignore_eos: bool
    path: str = "/v1/chat/completions"  # or /v1/completions (bench/serve/client.py)


def run_against(base_url: str, load: Load, api_key: str | None = None) -> Summary:
    """The load run once against `base_url` (every request carrying `api_key`, if any): the
    summary, with the spread behind a router and the hit-rate models of a multi-turn run."""
    import httpx

    from bench.serve.client import Endpoint, run_benchmark
    from bench.serve.hit_model import (
        ceiling_hit_rate,
        conversations,
        round_robin_hit_rate,
    )

    endpoint = Endpoint(base_url, load.path, api_key)
    models_url = endpoint.url("/v1/models")
    try:
        resp = httpx.get(models_url, headers=endpoint.headers, timeout=30)
        if resp.status_code != 200:  # a 401: no --api-key, or the wrong one
            raise click.ClickException(f"{models_url}: HTTP {resp.status_code}: {resp.text[:200]}")
        model = resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, httpx.HTTPError) as err:
        raise click.ClickException(f"{models_url}: {err}") from err
    extra = {"ignore_eos": True} if load.ignore_eos else {}
    before = replica_counts(base_url, endpoint.headers)
    results, duration = asyncio.run(
        run_benchmark(
            endpoint,
            model,
            load.sessions,
            load.max_concurrency,
            load.request_rate,
            load.seed,
            extra,
        )
    )
    after = replica_counts(base_url, endpoint.headers)
    spread = None
    if before is not None and after is not None:
        spread = [a - b for a, b in zip(after, before, strict=True)]
    summary = summarise(results, duration, spread)
    summary |= {"base_url": base_url, "endpoint": load.path, "model_id": model}
    summary |= {"backend": "openai-chat" if endpoint.chat else "openai"}  # vLLM's names
    summary |= {"max_concurrency": load.max_concurrency, "num_prompts": len(load.sessions)}
    rate = load.request_rate
    summary["request_rate"] = rate if rate != float("inf") else "inf"  # as vLLM writes it
    if any(s.turns > 1 for s in load.sessions):
        convs = conversations(results)
        summary["model_hit_rate_ceiling"] = ceiling_hit_rate(convs)
        replicas = len(spread) if spread else 1
        summary["model_hit_rate_round_robin"] = round_robin_hit_rate(convs, replicas)
    return summary


def compare_with_llama_server(
    binary: str, gguf: str | None, load: Load, ours: Summary, args: str
) -> Summary:
    """The same sessions against a llama-server started here; its report, then both side by
    side."""
    from bench.serve.compare import print_comparison
    from bench.serve.llama_server import running_llama_server
    from runner.model.gguf import default_gguf_path

    try:
        path = Path(gguf) if gguf is not None else default_gguf_path()
        with running_llama_server(binary, path, load.max_concurrency, args) as url:
            click.echo(f"llama-server ({binary}, {path.name}) on {url}")
            theirs = run_against(url, load)
    except (ValueError, RuntimeError) as err:
        raise click.ClickException(str(err)) from err
    theirs |= {"binary": binary, "gguf": str(path), "args": args}
    print_report(theirs)
    print_comparison(ours, theirs)
    return theirs
