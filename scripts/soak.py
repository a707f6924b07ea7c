"""Soak test: many requests of a mixed workload through one LLM with a small KV pool.

    python scripts/soak.py --requests 10000            # tiny random Llama, built on the fly
    python scripts/soak.py --requests 2000 --model DIR

The workload mixes shared system prompts, unique prompts, exact repeats, multi-turn follow-ups
(previous prompt + its answer + more), two salts, greedy and sampled (half seeded) requests,
stop tokens and max_tokens 1..8. Requests are fed as a stream (at most --inflight live), and the
engine loop is driven by hand so the block manager can be checked after every step.

Checked (a failed check is printed and the exit code is 1):
  * every request finishes exactly once, and each finishes for a stated reason;
  * no leak: when all are done no block is in use, free + cached == pool, no live request,
    and `check_integrity()` holds after every --check-every steps and at the end;
  * accounting: query tokens == prompt tokens submitted, hit tokens == sum of the outputs'
    num_cached_tokens, and hit + miss == query, where miss is counted from what the model was
    actually fed during each request's first admission;
  * consistency: greedy answers to the same prompt agree (one is a prefix of the other), and
    every copy of each fixed "canary" request (one greedy, one seeded-sampled) is identical;
  * memory: resident memory (RSS) grows less than --max-rss-growth from the end of the first
    --chunk requests to the end of the last.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Run as a file (`python scripts/soak.py`): make the checkout's packages importable. This file
# is only the command line; the soak is bench/soak.py (driver),
# bench/soak_workload.py (model and requests) and bench/soak_checks.py (checks and
# report).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.engine.config import CPU_WEIGHT_DTYPES, KV_CACHE_DTYPES  # noqa: E402  (light: no torch)
from runner.engine.step.policies.registry import POLICIES as SCHEDULING_POLICIES  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--model", help="HF model folder (default: a tiny random Llama)")
    p.add_argument("--num-kv-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument(
        "--inflight", type=int, default=32, help="most requests live at once (0: all at once)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=1000, help="requests per RSS sample")
    p.add_argument("--check-every", type=int, default=1, help="steps between integrity checks")
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--batching", choices=list(SCHEDULING_POLICIES), default="continuous")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step budget")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny model: 1)")
    p.add_argument(
        "--no-metrics", action="store_true", help="record no per-step or per-request metrics"
    )
    p.add_argument("--cpu-weight-dtype", choices=CPU_WEIGHT_DTYPES, default="float32")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="guessed tokens a step for greedy requests (every greedy answer is compared with "
        "an engine that guesses nothing)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Imported after parsing so `--help` answers without loading torch and the engine; the
    # thread count is set first, as before any model code runs.
    import torch

    torch.set_num_threads(args.threads)
    from bench.soak import run_soak
    from bench.soak_workload import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="kvcache-soak-") as tmp:
        model = args.model or str(build_tiny_llama(Path(tmp) / "tiny-llama"))
        rep = run_soak(
            model,
            args.requests,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            inflight=args.inflight,
            seed=args.seed,
            chunk=args.chunk,
            check_every=args.check_every,
            max_rss_growth=args.max_rss_growth,
            record_metrics=not args.no_metrics,
            batching=args.batching,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cpu_weight_dtype=args.cpu_weight_dtype,
            speculative_tokens=args.speculative_tokens,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    print(rep.table())
    return 0 if not rep.failures else 1


if __name__ == "__main__":
    sys.exit(main())
