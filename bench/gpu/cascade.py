"""The shared-prefix decode against the plain one, timed on a GPU: data to fit and check the
cost model (runner/backends/triton/cascade_cost.py).

`python -m bench.gpu.cascade --out FILE` builds, for each prefix length (16..4,096
tokens) and group size (2..256 decodes), one decode step's attention over a paged cache: the
group's members share the prefix's blocks and each has 50..200 tokens of its own. It times the
plain split-K decode and the shared-prefix decode (prefix pass, own passes, reduce), each
captured in a CUDA graph as the engine runs it and replayed back to back, checks that both give
the same output, and records the cost model's decision beside the measured ratio. The rule the
model must keep: wherever it says yes, the shared-prefix decode is not slower than the plain
one by more than `--noise`. `fit` gives the smallest min_saved_bytes that keeps that rule over
the measured points and the largest win it leaves out. `--device cpu --quick` runs a few toy
points in Triton's interpreter (the timings then mean nothing): the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench.gpu.step_profile import replay_ms
from runner.backends.torch.cascade import PrefixGroup
from runner.backends.triton.cascade_cost import DEFAULT_THRESHOLDS, saved_bytes, use_shared_prefix
from runner.backends.triton.decode import decode_attention
from runner.backends.triton.shared_prefix import (
    SharedPrefixPlan,
    build_shared_prefix_plan,
    members_per_chunk,
)

PREFIXES = [16, 64, 256, 1024, 2048, 4096]
GROUPS = [2, 4, 8, 32, 128, 256]
# Attention shapes (query heads, KV heads, head dim) of the bench's models.
SHAPES = {"qwen3-0.6b": (16, 8, 128), "smollm2-135m": (9, 3, 64), "tiny": (4, 2, 32)}


class DecodeStep(NamedTuple):
    q: torch.Tensor  # [S, Hq, D]
    k_cache: torch.Tensor  # [blocks, B, Hkv, D]
    v_cache: torch.Tensor
    context_lens: torch.Tensor  # [S] int32
    tables: torch.Tensor  # [S, max_blocks] int32
    plan: SharedPrefixPlan


def make_step(
    prefix: int,
    group: int,
    shape: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> DecodeStep:
    """One decode step: q, the caches, context lengths, block tables and the shared-prefix plan
    of `group` decodes behind `prefix` shared tokens (rounded down to whole blocks)."""
    hq, hkv, dim = shape
    rng = random.Random(seed)
    shared = max(1, prefix // block_size)
    own = [rng.randint(50, 200) for _ in range(group)]
    own_blocks = [-(-n // block_size) for n in own]
    num_blocks = shared + sum(own_blocks) + 1
    tables = torch.zeros(group, shared + max(own_blocks), dtype=torch.int32)
    start = shared
    for s, n in enumerate(own_blocks):
        tables[s, :shared] = torch.arange(shared)
        tables[s, shared : shared + n] = torch.arange(start, start + n)
        start += n
    ctx = torch.tensor([shared * block_size + n for n in own], dtype=torch.int32)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = (num_blocks, block_size, hkv, dim)
    k_cache = torch.randn(cache, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(cache, generator=gen, device=device).to(dtype)
    q = torch.randn(group, hq, dim, generator=gen, device=device).to(dtype)
    members = members_per_chunk(hq // hkv, dtype)
    groups = [PrefixGroup(list(range(group)), list(range(shared)))]
    plan = build_shared_prefix_plan(groups, group, block_size, members, device)
    return DecodeStep(q, k_cache, v_cache, ctx.to(device), tables.to(device), plan)


def time_us(run: Callable[[], torch.Tensor], device: str, repeats: int) -> float:
    """Microseconds a call: on CUDA a graph of one call replayed `repeats` times between two
    events (the launches as the engine's decode graph makes them); else wall time."""
    run()  # compile, warm
    if not device.startswith("cuda"):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        return 1e6 * (time.perf_counter() - start) / repeats
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    return 1e3 * replay_ms(graph, repeats)


def measure_point(
    prefix: int,
    group: int,
    shape_name: str,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    repeats: int,
) -> dict[str, Any]:
    """One (prefix, group) point: both decodes timed, their outputs compared, the model's say."""
    shape = SHAPES[shape_name]
    q, k_cache, v_cache, ctx, tables, plan = make_step(
        prefix, group, shape, block_size, dtype, device
    )
    max_ctx = int(ctx.max())
    scale = shape[2] ** -0.5

    def plain() -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, ctx, tables, scale, max_ctx)

    def shared() -> torch.Tensor:
        return decode_attention(
            q, k_cache, v_cache, ctx, tables, scale, max_ctx, shared_prefix=plan
        )

    diff = float((plain().float() - shared().float()).abs().max())
    plain_us = time_us(plain, device, repeats)
    shared_us = time_us(shared, device, repeats)
    per_token = 2 * shape[1] * shape[2] * k_cache.element_size()
    shared_tokens = int(plan.chunk_prefix_lens.max())
    reads = plan.chunks_per_group[0]
    return {
        "prefix": shared_tokens,
        "group": group,
        "plain_us": plain_us,
        "shared_us": shared_us,
        "ratio": shared_us / plain_us,
        "max_abs_diff": diff,
        "prefix_reads": reads,
        "saved_bytes": saved_bytes(shared_tokens, group, reads, per_token),
        "model_says": use_shared_prefix(shared_tokens, group, reads, per_token),
    }


def fit(points: list[dict[str, Any]], noise: float) -> dict[str, Any]:
    """Where the default model chooses wrong, the smallest min_saved_bytes that keeps the rule
    (every point saving at least that much wins, within `noise`), and the best win below it."""
    slower = [p for p in points if p["ratio"] > 1 + noise]
    wrong = [p for p in slower if p["model_says"]]
    bound = max((p["saved_bytes"] for p in slower), default=-1) + 1
    missed = [p for p in points if p["saved_bytes"] < bound and p["ratio"] < 1 - noise]
    return {
        "noise": noise,
        "default_min_saved_bytes": DEFAULT_THRESHOLDS.min_saved_bytes,
        "wrong_choices": [[p["prefix"], p["group"], round(p["ratio"], 3)] for p in wrong],
        "keeps_rule": not wrong,
        "fitted_min_saved_bytes": bound,
        "wins_left_out_by_fit": [[p["prefix"], p["group"], round(p["ratio"], 3)] for p in missed],
        "best_ratio": min((p["ratio"] for p in points), default=None),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--noise", type=float, default=0.05, help="relative timing noise allowed")
    p.add_argument("--quick", action="store_true", help="a few toy points (CPU smoke test)")
    args = p.parse_args(argv)
    prefixes, groups = PREFIXES, GROUPS
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.quick:
        args.shape, args.repeats, prefixes, groups = "tiny", 1, [16, 64], [2, 3]
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "points": []}
    for prefix in prefixes:
        for group in groups:
            point = measure_point(
                prefix, group, args.shape, args.block_size, dtype, args.device, args.repeats
            )
            report["points"].append(point)
            print(json.dumps(point), flush=True)
            report["fit"] = fit(report["points"], args.noise)
            save(report, args.out)  # after each point: a run cut short keeps what it measured
    print(json.dumps(report["fit"]), flush=True)
    return report


def save(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
