"""Figures of the tiers below the device pool (docs/TIERS.md), each measured in one run so that
its ratios compare like with like: ``kvcache bench --workload tiers-FIGURE`` (its options
map onto the figure's through ``figure_args``) or ``python -m bench.tiers FIGURE``.
``--redis URL`` adds the Redis rows; ``--redis auto`` starts a redis-server of its own.

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
from collections.abc import Mapping
from typing import Any

import click

from bench.local_redis import redis_url as local_redis
from kvcache import LLM, SamplingParams
from runner.engine.api.interface import EngineInterface

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
VOCAB = 300  # token ids 3..299: ordinary tokens of the default model and the tiny test models


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _run(llm: EngineInterface, prompts: list[list[int]], wave: int) -> float:
    """Send the prompts in waves of ``wave`` (arrivals, not one batch the admission could
    reorder whole); returns the wall time."""
    start = time.perf_counter()
    for i in range(0, len(prompts), wave):
        llm.generate(prompts[i : i + wave], ANSWER)
    llm.flush_cache_tiers()
    return time.perf_counter() - start


# `kvcache bench` option -> each figure's own option (a figure not listed does not take it).
FIGURE_OPTIONS: dict[str, dict[str, str]] = {
    "working-set": {"prompts": "--systems", "prompt_tokens": "--system-tokens",
                    "redis": "--redis", "repeat": "--repeat", "chunk_tokens": "--chunk-tokens"},
    "restart": {"prompts": "--prompts", "prompt_tokens": "--prompt-tokens", "redis": "--redis",
                "chunk_tokens": "--chunk-tokens"},
    "replicas": {"prompts": "--conversations", "redis": "--redis"},
    "per-block": {"prompt_tokens": "--prompt-tokens", "redis": "--redis",
                  "chunk_tokens": "--chunk-tokens"},
}  # fmt: skip
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
CLI_NAMES = {"prompts": "--prompts", "prompt_tokens": "--prompt-tokens", "redis": "--redis",
             "repeat": "--repeat", "chunk_tokens": "--cache-chunk-tokens"}  # fmt: skip


def figure_args(figure: str, model: str | None, given: Mapping[str, str | int | None]) -> list[str]:
    """The figure's command line for `kvcache bench`'s options (those not None). Raises
    ValueError naming an option the figure does not take. Pure."""
    known = FIGURE_OPTIONS[figure]
    args = ["--model", model] if model else []
    for name, value in given.items():
        if value is None:
            continue
        if name not in known:
            raise ValueError(f"{CLI_NAMES[name]} does not apply to tiers-{figure}")
        if name == "redis" and value != "auto" and not str(value).startswith(_REDIS_SCHEMES):
            raise ValueError(f"--redis takes redis://host:port/db or auto, got {value!r}")
        args += [known[name], str(value)]
    return [figure, *args]


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
@click.option("--redis", "redis", default=None, help="redis://... or auto: the Redis rows.")
@click.option("--repeat", default=1, show_default=True)
@click.option("--chunk-tokens", default=256, show_default=True, help="cache_chunk_tokens.")
def working_set(
    model: str | None,
    systems: int,
    system_tokens: int,
    questions: int,
    pool_share: float,
    wave: int,
    redis: str | None,
    repeat: int,
    chunk_tokens: int,
) -> None:
    rng = random.Random(0)
    vocab = VOCAB
    heads = [_tokens(rng, system_tokens, vocab) for _ in range(systems)]
    prompts = [h + _tokens(rng, 20, vocab) for h in heads for _ in range(questions)]
    rng.shuffle(prompts)
    per_prompt = -(-(system_tokens + 20 + ANSWER.max_tokens) // 16)
    pool = max(wave * per_prompt, int(systems * per_prompt * pool_share))
    host: dict[str, Any] = {"host_cache_bytes": 2**36}
    with local_redis(redis) as url:
        tiers: list[tuple[str, dict[str, Any]]] = [("no tiers", {}), ("+ host", host)]
        tiers.append(("+ disk", {"disk_cache_dir": ""}))
        if url:
            tiers.append(("+ remote", {"remote_cache_url": url}))
            tiers.append(("host + disk + remote", {**host, "disk_cache_dir": "",
                                                    "remote_cache_url": url}))  # fmt: skip
        # The upper bound first: each row of the last round prints as soon as it is measured.
        configs = [("unbounded pool", {"num_kv_blocks": systems * per_prompt * questions})]
        configs += [(name, {"num_kv_blocks": pool, "cache_chunk_tokens": chunk_tokens, **o})
                    for name, o in tiers]  # fmt: skip
        click.echo(f"{len(prompts)} requests, {systems} system prompts of {system_tokens} "
                   f"tokens, pool {pool} blocks of 16, chunks of {chunk_tokens} tokens; wall "
                   f"time the least of {repeat} runs")  # fmt: skip
        LLM(model, num_kv_blocks=pool).generate(prompts[:wave], ANSWER)  # the process warms up
        walls: dict[str, list[float]] = {name: [] for name, _ in configs}
        for round_ in range(repeat):  # round robin: a busy spell hits every row alike
            if round_ == repeat - 1:
                click.echo("| tiers | hit rate | prefill tokens computed | wall s | against "
                           "unbounded | tier load s | dropped writes |\n"
                           "|---|---|---|---|---|---|---|")  # fmt: skip
            for name, options in configs:
                if "disk_cache_dir" in options:
                    options = {**options, "disk_cache_dir": tempfile.mkdtemp()}
                if "remote_cache_url" in options:
                    _flush_redis(options["remote_cache_url"])
                llm = LLM(model, **options)
                walls[name].append(_run(llm, prompts, wave))
                if round_ == repeat - 1:
                    top = min(walls["unbounded pool"])
                    click.echo(_row(name, llm, min(walls[name]), top))


def _row(name: str, llm: EngineInterface, wall: float, top: float) -> str:
    s = llm.stats()
    computed = s["query_tokens"] - s["hit_tokens"] + s["readmit_query_tokens"]
    computed -= s["readmit_hit_tokens"]
    tiers = s.get("cache_tiers") or {}
    load_s = tiers.get("loaded_blocks", 0) * tiers.get("load_ms_per_block", 0.0) / 1000
    return (f"| {name} | {s['hit_rate']:.1%} | {computed:,} | {wall:.1f} | {wall / top:.2f}x "
            f"| {load_s:.2f} | {tiers.get('dropped_writes', 0)} |")  # fmt: skip


def _flush_redis(url: str) -> None:
    """Each run starts with an empty server, as the first run did."""
    import redis

    redis.Redis.from_url(url).flushdb()


@main.command()
@click.option("--model", default=None)
@click.option("--prompts", "count", default=8, show_default=True)
@click.option("--prompt-tokens", default=700, show_default=True)
@click.option("--redis", "redis", default=None, help="redis://... or auto: the Redis row.")
@click.option("--chunk-tokens", default=256, show_default=True, help="cache_chunk_tokens.")
def restart(
    model: str | None, count: int, prompt_tokens: int, redis: str | None, chunk_tokens: int
) -> None:
    rng = random.Random(1)
    vocab = VOCAB
    prompts = [_tokens(rng, prompt_tokens, vocab) for _ in range(count)]
    with local_redis(redis) as url:
        tiers: list[tuple[str, dict[str, Any]]] = [("disk", {"disk_cache_dir": tempfile.mkdtemp()})]
        if url:
            tiers.append(("remote", {"remote_cache_url": url}))
        click.echo("| second engine | mean TTFT s | against a cold start |\n|---|---|---|")
        cold = _ttft(LLM(model), prompts)
        click.echo(f"| cold (no tiers) | {cold:.3f} | 1.0x |")
        for name, options in tiers:
            options["cache_chunk_tokens"] = chunk_tokens
            first = LLM(model, **options)
            _run(first, prompts, 1)
            del first
            warm = _ttft(LLM(model, **options), prompts)
            click.echo(f"| {name} | {warm:.3f} | {cold / warm:.1f}x lower |")


def _ttft(llm: EngineInterface, prompts: list[list[int]]) -> float:
    """Mean time to the first token of each prompt, alone, once the engine has run one short
    request of other tokens (a server warms up before it takes traffic)."""
    llm.generate([[VOCAB + 1] * 20], ONE)
    start = time.perf_counter()
    for p in prompts:
        llm.generate([p], ONE)
    return (time.perf_counter() - start) / len(prompts)


@main.command()
@click.option("--model", default=None)
@click.option("--conversations", default=16, show_default=True)
@click.option("--turns", default=4, show_default=True)
@click.option("--pool", default=64, show_default=True, help="Blocks per replica.")
@click.option("--redis", "redis", default="auto", show_default=True, help="redis://... or auto.")
def replicas(model: str | None, conversations: int, turns: int, pool: int, redis: str) -> None:
    with local_redis(redis) as url:
        assert url is not None
        _replicas(model, conversations, turns, pool, url)


def _replicas(model: str | None, conversations: int, turns: int, pool: int, redis_url: str) -> None:
    rng = random.Random(2)
    vocab = VOCAB
    system = _tokens(rng, 200, vocab)
    setups: list[tuple[str, list[EngineInterface]]] = [
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
@click.option("--redis", "redis", default=None, help="redis://... or auto: the Redis rows.")
@click.option("--cache-key", default=None, help="MAC every value (its cost is in the loads).")
@click.option("--chunk-tokens", default=256, show_default=True, help="Against 16: one block.")
def per_block(
    model: str | None,
    prompt_tokens: int,
    redis: str | None,
    cache_key: str | None,
    chunk_tokens: int,
) -> None:
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
    click.echo("| tier | tokens a value | load ms per block | compute ms per block | ratio | "
               "bytes read per token |\n|---|---|---|---|---|---|")  # fmt: skip
    with local_redis(redis) as url:
        host = {"host_cache_bytes": 2**34, "chunk": 16}  # written on eviction: one block each
        tiers: list[tuple[str, dict[str, Any]]] = [("host", host)]
        for chunk in dict.fromkeys((chunk_tokens, 16)):
            tiers.append(("disk", {"disk_cache_dir": tempfile.mkdtemp(), "chunk": chunk}))
            if url:
                tiers.append(("remote", {"remote_cache_url": url, "chunk": chunk}))
        for name, options in tiers:
            chunk = options.pop("chunk", 16)
            options |= {"cache_key": cache_key, "cache_chunk_tokens": chunk}
            if url:
                _flush_redis(url)
            writer = LLM(model, num_kv_blocks=blocks + 2, **options)
            writer.generate([prompt], ONE)
            writer.generate([_tokens(random.Random(5), prompt_tokens, 300)], ONE)  # evicts it
            writer.flush_cache_tiers()
            reader = writer if name == "host" else LLM(model, **options)
            before = reader.stats()["cache_tiers"]["tiers"][name]["read_bytes"]
            reader.generate([prompt], ONE)
            tier_stats = reader.stats()["cache_tiers"]
            load_ms = tier_stats["load_ms_per_block"]
            per_token = (tier_stats["tiers"][name]["read_bytes"] - before) / prompt_tokens
            ratio = compute_ms / max(load_ms, 1e-9)
            click.echo(f"| {name} | {chunk} | {load_ms:.2f} | {compute_ms:.2f} | {ratio:.0f}x "
                       f"| {per_token:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
