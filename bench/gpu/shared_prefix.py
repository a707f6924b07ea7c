"""The GPU bench's shared-prefix workload: many requests behind one long system prompt.

256 requests share a 2,048-token system prompt, each adds 50..200 tokens of its own and asks
for 128 new tokens (EOS ignored, greedy). It runs four ways through kvcache.LLM:

- `cache_off`: no prefix cache, every prompt prefilled whole (decode graphs on);
- `cache_on`: the prefix cache (the system prompt prefilled once), decode graphs on: the
  engine's default, whose graphs capture shared-prefix attention too and replay it where the
  cost model keeps a group (runner/model/cuda_graphs.py; `cuda_graph_prefix_replays` says how
  many steps did);
- `cache_on_eager`: the prefix cache, decodes launched eagerly, every prefix read per sequence;
- `shared_prefix`: the same, eager, with shared-prefix attention: each decode step reads the
  system prompt's K/V once per chunk of the group (runner/backends/triton/shared_prefix.py).

The third way is the eager baseline of the fourth, the first the baseline of the second. Each
way counts the K/V bytes its decode steps read from the plans they executed (the graphs' plan
of each replay, the eager backend's of each step: `ExecutedReads`), against the ideal (the
prefix's whole blocks read once a step, every suffix once; the target is at most 1.2x), and
`step_bytes` sets the same for one step at the full batch as the cost model would plan it. A
way's figures are handed to `on_way` as soon as it ends. `--quick` shapes (tiny model, a few
requests, every group read once) run in a CPU test.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu.floor import ModelBytes, decode_floor, shared_prefix_step_bytes
from bench.workloads import BenchRequest
from runner.attention.backend import Attend, AttentionBackend, AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.triton.cascade_cost import (
    ALWAYS,
    DEFAULT_THRESHOLDS,
    NEVER,
    CascadeThresholds,
)
from runner.backends.triton.shared_prefix import SharedPrefixPlan, decode_kv_bytes
from runner.engine.api.interface import ProfilingEngine


def make_shared_prefix_workload(
    num_seqs: int,
    prefix_len: int,
    own_lens: tuple[int, int],
    max_tokens: int,
    token_range: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_seqs` prompts: one seeded `prefix_len`-token system prompt, then each prompt's own
    tokens (a length uniform in `own_lens`), ids uniform in `token_range` (inclusive)."""
    rng = random.Random(seed)
    lo, hi = token_range
    system = [rng.randint(lo, hi) for _ in range(prefix_len)]
    return [
        BenchRequest(
            str(i),
            system + [rng.randint(lo, hi) for _ in range(rng.randint(*own_lens))],
            max_tokens,
        )
        for i in range(num_seqs)
    ]


def step_bytes_report(
    requests: list[BenchRequest],
    prefix_len: int,
    sizes: ModelBytes,
    block_size: int,
    kv_dtype: torch.dtype,
    bytes_per_s: float,
) -> dict[str, Any]:
    """Bytes one decode step of every request reads halfway through its output, both ways,
    against the ideal (the prefix's whole blocks once, every rest once), with their floors."""
    contexts = [len(r.prompt_token_ids) + r.max_tokens // 2 for r in requests]
    got = shared_prefix_step_bytes(prefix_len, contexts, sizes, block_size, kv_dtype)
    shared_tokens = prefix_len // block_size * block_size
    ideal = (shared_tokens + sum(c - shared_tokens for c in contexts)) * sizes.kv_per_token
    ideal *= sizes.num_layers
    weights = sizes.weights
    return {
        "batch": len(contexts),
        "kv_bytes_plain": got.plain,
        "kv_bytes_shared_prefix": got.shared,
        "kv_bytes_ideal": ideal,
        "shared_over_ideal": got.shared / ideal,
        "weight_bytes": weights,
        "floor_ms_plain": 1e3 * (got.plain + weights) / bytes_per_s,
        "floor_ms_shared_prefix": 1e3 * (got.shared + weights) / bytes_per_s,
    }


class ExecutedReads:
    """The K/V a run's decode steps read, from the plans they executed: per step, its rows,
    the tokens it read in one layer (a group's prefix once per chunk where a plan read it so,
    every other context whole), and the ideal (`shared_tokens` once, every row's rest once).
    Counts only while `counting` (the timed run, not the warm-up)."""

    def __init__(self, shared_tokens: int) -> None:
        self.shared_tokens = shared_tokens
        self.counting = False
        self.steps: list[tuple[int, int, int, bool]] = []  # rows, read, ideal, with a plan

    def on_step(self, contexts: list[int], plan: SharedPrefixPlan | None) -> None:
        if not self.counting or not contexts:
            return
        read = decode_kv_bytes(contexts, plan, 1, 1).shared
        shared = self.shared_tokens
        ideal = shared + sum(max(c - shared, 0) for c in contexts)
        self.steps.append((len(contexts), read, ideal, plan is not None))

    def report(self, sizes: ModelBytes) -> dict[str, Any]:
        """Bytes read against the ideal over every counted step, and at the steps of the
        widest batch (the figure the target is set on)."""
        scale = sizes.kv_per_token * sizes.num_layers
        if not self.steps:
            return {"decode_steps_counted": 0}
        widest = max(rows for rows, *_ in self.steps)
        full = [s for s in self.steps if s[0] == widest]
        read, ideal = sum(s[1] for s in self.steps), sum(s[2] for s in self.steps)
        return {
            "decode_steps_counted": len(self.steps),
            "steps_with_a_plan": sum(s[3] for s in self.steps),
            "kv_bytes_read": read * scale,
            "kv_bytes_ideal": ideal * scale,
            "read_over_ideal": read / ideal,
            "full_batch": widest,
            "full_batch_read_over_ideal": sum(s[1] for s in full) / sum(s[2] for s in full),
            "full_batch_kv_bytes_per_step": sum(s[1] for s in full) * scale // len(full),
        }


def counted(backend: AttentionBackend, reads: ExecutedReads) -> AttentionBackend:
    """`backend` telling `reads` of each eager decode step, once a step (its first layer), with
    the shared-prefix plan the step ran with (None for a backend that plans none)."""
    from runner.backends.triton.attention import planned_shared_prefix

    def wrap(attend: Attend | None) -> Attend | None:
        if attend is None:
            return None
        inner = attend
        seen: list[AttentionMetadata] = []

        def counting(call: AttentionCall) -> torch.Tensor:
            out = inner(call)
            meta = call.meta
            if meta.decode_only and not (seen and seen[0] is meta):
                seen[:] = [meta]
                reads.on_step(list(meta.context_lens_host), planned_shared_prefix(meta))
            return out

        return counting

    attend = wrap(backend.attend)
    assert attend is not None
    return replace(backend, attend=attend, attend_stored=wrap(backend.attend_stored))


RunKVCache = Callable[..., dict[str, Any]]
OnWay = Callable[[str, dict[str, Any]], None]


def run_shared_prefix_ways(
    run_kvcache: RunKVCache,
    folder: Path,
    requests: list[BenchRequest],
    device: str,
    options: dict[str, Any],
    bytes_per_s: float,
    quick: bool,
    shared_tokens: int,
    on_way: OnWay | None = None,
) -> dict[str, Any]:
    """The workload run four ways (see the module's docstring), each with its decode floor and
    the bytes its executed plans read (`shared_tokens`: the prefix's whole blocks); in `quick`
    runs the shared-prefix way reads every group once whatever it saves (so the CPU test goes
    through the kernels), else the default cost model decides. `on_way(name, figures)` hears
    of each way as it ends."""
    from runner.backends.triton.attention import triton_backend

    def prepare_way(
        thresholds: CascadeThresholds | None, reads: ExecutedReads
    ) -> Callable[[ProfilingEngine], Callable[[], None]]:
        def prepare(llm: ProfilingEngine) -> Callable[[], None]:
            parts = llm.forward_parts()
            backend = parts.attention if thresholds is None else triton_backend(thresholds)
            llm.attend_through(counted(backend, reads))  # every eager step from now
            if parts.decode_graphs is not None:
                parts.decode_graphs.step_listeners.append(reads.on_step)

            def timed() -> None:  # the timed run starts: the warm-up is not counted
                reads.counting = True

            return timed

        return prepare

    cascade = ALWAYS if quick else DEFAULT_THRESHOLDS
    triton = {**options, "attention_backend": "triton"}
    ways: dict[str, tuple[dict[str, Any], CascadeThresholds | None]] = {
        "cache_off": ({**options, "enable_prefix_caching": False}, None),
        "cache_on": (options, None),
        "cache_on_eager": ({**triton, "enforce_eager": True}, NEVER),
        "shared_prefix": ({**triton, "enforce_eager": True}, cascade),
    }
    results: dict[str, Any] = {}
    tokens_of: dict[str, Any] = {}
    for name, (opts, thresholds) in ways.items():
        reads = ExecutedReads(shared_tokens)
        try:
            result = run_kvcache(
                folder,
                requests,
                device,
                opts,
                prepare=prepare_way(thresholds, reads),
                keep_tokens=True,
                profile=False,
            )
            sizes = ModelBytes(**result["model_bytes"])
            result["decode_floor"] = decode_floor(
                requests, sizes, result["decode_steps"], bytes_per_s
            )
            result["decode_over_floor"] = result["decode_s"] / result["decode_floor"]["floor_s"]
            result["executed_reads"] = reads.report(sizes)
        except Exception as err:  # one broken way must not cost the others their figures
            result = {"error": repr(err)}
        tokens_of[name] = result.pop("token_ids", None)
        base = tokens_of.get("cache_on")  # greedy: every way must give the same tokens
        for way, tokens in tokens_of.items():  # cache_off's is known once cache_on has run
            results.get(way, result)["same_tokens_as_cache_on"] = (
                None if base is None else tokens == base
            )
        results[name] = result
        if on_way is not None:
            on_way(name, result)
    return results
