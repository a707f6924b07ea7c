"""Figures of the tiers below the device pool (docs/TIERS.md), each measured in one run so that
its ratios compare like with like: ``python -m runner.bench_tiers FIGURE --model DIR``.

* working-set: more distinct system prompts than the pool holds, several questions each in
  shuffled order; hit rate, prefill tokens computed and wall time with no tiers, + host,
  + disk, + remote, and an unbounded pool (the upper bound).
* restart: a second engine on the first one's disk directory (or Redis): its time to first
  token on the first one's prompts against a cold start.
* replicas: two engines sharing Redis on a multi-turn workload, each turn sent to one at
  random, against two private caches and one cache of twice the size.
* per-block: the time to load a block from each tier against the time to compute it, and the
  bytes per token.
"""

from __future__ import annotations

import random
import tempfile
import time
from typing import Any

import click

from kvcache import LLM, SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
VOCAB = 300  # token ids 3..299: ordinary tokens of the default model and the tiny test models


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _run(llm: LLM, prompts: list[list[int]], wave: int) -> float:
    """Send the prompts in waves of ``wave`` (arrivals, not one batch the admission could
    reorder whole); returns the wall time."""
    start = time.perf_counter()
    for i in range(0, len(prompts), wave):
        llm.generate(prompts[i : i + wave], ANSWER)
    llm.flush_cache_tiers()
    return time.perf_counter() - start


def _row(name: str, llm: LLM, wall: float) -> str:
    s = llm.stats()
    computed = s["query_tokens"] - s["hit_tokens"] + s["readmit_query_tokens"]
    computed -= s["readmit_hit_tokens"]
    return f"| {name} | {s['hit_rate']:.1%} | {computed:,} | {wall:.1f} |"


@click.group()
def main() -> None:
    """Figures of the cache tiers (docs/TIERS.md)."""


@main.command("working-set")
@click.option("--model", default=None)
@click.option("--systems", default=64, show_default=True)
@click.option("--system-tokens", default=700, show_default=True)
@click.option("--questions", default=3, show_default=True)
@click.option("--pool-share", default=0.125, show_default=True, help="Of the system prompts.")
@click.option("--wave", default=4, show_default=True)
@click.option("--redis", "redis_url", default=None, help="redis://... for the remote row.")
def working_set(
    model: str | None,
    systems: int,
    system_tokens: int,
    questions: int,
    pool_share: float,
    wave: int,
    redis_url: str | None,
) -> None:
    rng = random.Random(0)
    vocab = VOCAB
    heads = [_tokens(rng, system_tokens, vocab) for _ in range(systems)]
    prompts = [h + _tokens(rng, 20, vocab) for h in heads for _ in range(questions)]
    rng.shuffle(prompts)
    per_prompt = -(-(system_tokens + 20 + ANSWER.max_tokens) // 16)
    pool = max(wave * per_prompt, int(systems * per_prompt * pool_share))
    big = 2**36
    configs: list[tuple[str, dict[str, Any]]] = [("no tiers", {"num_kv_blocks": pool})]
    configs.append(("+ host", {"num_kv_blocks": pool, "host_cache_bytes": big}))
    configs.append(("+ disk", {"num_kv_blocks": pool, "disk_cache_dir": tempfile.mkdtemp()}))
    if redis_url:
        configs.append(("+ remote", {"num_kv_blocks": pool, "remote_cache_url": redis_url}))
    configs.append(("unbounded pool", {"num_kv_blocks": systems * per_prompt * questions}))
    click.echo(f"{len(prompts)} requests, {systems} system prompts of {system_tokens} tokens, "
               f"pool {pool} blocks of 16")  # fmt: skip
    click.echo("| tiers | hit rate | prefill tokens computed | wall s |\n|---|---|---|---|")
    for name, options in configs:
        llm = LLM(model, **options)
        click.echo(_row(name, llm, _run(llm, prompts, wave)))


@main.command()
@click.option("--model", default=None)
@click.option("--prompts", "count", default=8, show_default=True)
@click.option("--prompt-tokens", default=700, show_default=True)
@click.option("--redis", "redis_url", default=None)
def restart(model: str | None, count: int, prompt_tokens: int, redis_url: str | None) -> None:
    rng = random.Random(1)
    vocab = VOCAB
    prompts = [_tokens(rng, prompt_tokens, vocab) for _ in range(count)]
    tiers: list[tuple[str, dict[str, Any]]] = [("disk", {"disk_cache_dir": tempfile.mkdtemp()})]
    if redis_url:
        tiers.append(("remote", {"remote_cache_url": redis_url}))
    click.echo("| second engine | mean TTFT s | against a cold start |\n|---|---|---|")
    cold = _ttft(LLM(model), prompts)
    click.echo(f"| cold (no tiers) | {cold:.3f} | 1.0x |")
    for name, options in tiers:
        first = LLM(model, **options)
        _run(first, prompts, 1)
        del first
        warm = _ttft(LLM(model, **options), prompts)
        click.echo(f"| {name} | {warm:.3f} | {cold / warm:.1f}x lower |")


def _ttft(llm: LLM, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    for p in prompts:
        llm.generate([p], ONE)
    return (time.perf_counter() - start) / len(prompts)


@main.command()
@click.option("--model", default=None)
@click.option("--conversations", default=16, show_default=True)
@click.option("--turns", default=4, show_default=True)
@click.option("--pool", default=64, show_default=True, help="Blocks per replica.")
@click.option("--redis", "redis_url", required=True)
def replicas(model: str | None, conversations: int, turns: int, pool: int, redis_url: str) -> None:
    rng = random.Random(2)
    vocab = VOCAB
    system = _tokens(rng, 200, vocab)
    setups: list[tuple[str, list[LLM]]] = [
        ("two private caches", [LLM(model, num_kv_blocks=pool) for _ in range(2)]),
        ("one cache of twice the size", [LLM(model, num_kv_blocks=2 * pool)]),
        ("two sharing Redis", [LLM(model, num_kv_blocks=pool, remote_cache_url=redis_url)
                               for _ in range(2)]),
    ]  # fmt: skip
    click.echo("| replicas | hit rate |\n|---|---|")
    for name, engines in setups:
        pick = random.Random(3)
        talks = [system + _tokens(random.Random(10 + c), 30, vocab) for c in range(conversations)]
        for _ in range(turns):
            for c in range(conversations):
                llm = pick.choice(engines)
                out = llm.generate([talks[c]], ANSWER)[0]
                llm.flush_cache_tiers()
                talks[c] = talks[c] + out.token_ids + _tokens(pick, 20, vocab)
        query = sum(e.stats()["query_tokens"] for e in engines)
        hits = sum(e.stats()["hit_tokens"] for e in engines)
        click.echo(f"| {name} | {hits / query:.1%} |")


@main.command("per-block")
@click.option("--model", default=None)
@click.option("--prompt-tokens", default=512, show_default=True)
@click.option("--redis", "redis_url", default=None)
def per_block(model: str | None, prompt_tokens: int, redis_url: str | None) -> None:
    prompt = _tokens(random.Random(4), prompt_tokens + 1, VOCAB)
    blocks = prompt_tokens // 16
    cold = LLM(model)
    start = time.perf_counter()
    cold.generate([prompt], ONE)
    compute_ms = 1000 * (time.perf_counter() - start) / blocks
    spec = cold.block_spec
    click.echo(f"bytes per token {spec.block_nbytes // spec.block_size:,} "
               f"({spec.num_layers} layers x 2 x {spec.num_kv_heads} heads x {spec.head_dim} "
               f"x {spec.dtype})")  # fmt: skip
    click.echo("| tier | load ms per block | compute ms per block | ratio |\n|---|---|---|---|")
    tiers: list[tuple[str, dict[str, Any]]] = [("host", {"host_cache_bytes": 2**34})]
    tiers.append(("disk", {"disk_cache_dir": tempfile.mkdtemp()}))
    if redis_url:
        tiers.append(("remote", {"remote_cache_url": redis_url}))
    for name, options in tiers:
        writer = LLM(model, num_kv_blocks=blocks + 2, **options)
        writer.generate([prompt], ONE)
        writer.generate([_tokens(random.Random(5), prompt_tokens, 300)], ONE)  # evicts it
        writer.flush_cache_tiers()
        reader = writer if name == "host" else LLM(model, **options)
        reader.generate([prompt], ONE)
        load_ms = reader.stats()["cache_tiers"]["load_ms_per_block"]
        click.echo(f"| {name} | {load_ms:.2f} | {compute_ms:.2f} | {compute_ms / load_ms:.0f}x |")


if __name__ == "__main__":
    main()
