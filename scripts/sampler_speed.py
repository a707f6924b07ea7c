"""The sampler's cost per step: ms per 16 sampled rows, before (the dense filters and the one-pass
draw over the whole vocabulary, plus an argmax of every row, as `sample` ran them) and after
(`runner.sampling.sampler.sample`), on one torch thread.

    python scripts/sampler_speed.py [--rows 16] [--vocabs 49152,151936,262144]

Logits are `randn * 5` (peaked, as a trained LM's mostly are) or `randn * 1` (flat: nuclei of
much of the vocabulary, the slow, rare case), at temperature 0.7.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.sampling.params import SamplingParams  # noqa: E402
from runner.sampling.sampler import dense_probs, sample, walk  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "top_p 0.9": {"top_p": 0.9},
    "top_k 50": {"top_k": 50},
    "top_k 64 + top_p 0.95": {"top_k": 64, "top_p": 0.95},  # Gemma 3's generation config
    "min_p 0.1": {"min_p": 0.1},
    "temperature only": {},
}


def before(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> list[int]:
    """`sample` as it was: an argmax of every row, the dense filters, a draw over every token."""
    tokens = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    index = torch.tensor(rows, device=logits.device)
    probs = dense_probs(logits.index_select(0, index), [params[i] for i in rows])
    uniforms = torch.cat([torch.rand(1, generator=gens[i]) for i in rows])
    tokens.index_copy_(0, index, walk(probs, uniforms))
    return [int(t) for t in tokens.tolist()]


def ms_per_call(fn: Callable[[], object], budget_s: float = 0.4) -> float:
    """Median wall time of one call, over as many calls as fit in `budget_s` (at least 3)."""
    fn()  # warm-up: allocator, lazy kernels
    times: list[float] = []
    while len(times) < 3 or sum(times) < budget_s:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocabs", default="49152,151936,262144")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"ms per {args.rows} rows, one torch thread, temperature 0.7 (torch {torch.__version__})")
    print(f"{'vocab':>7}  {'logits':<7} {'setting':<22} {'before':>9} {'after':>9} {'speedup':>8}")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for shape, spread in (("peaked", 5.0), ("flat", 1.0)):
            logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0))
            logits *= spread
            for name, options in SETTINGS.items():
                params = [SamplingParams(temperature=0.7, **options) for _ in range(args.rows)]
                gens: list[torch.Generator | None] = [
                    torch.Generator().manual_seed(i) for i in range(args.rows)
                ]
                old = ms_per_call(partial(before, logits, params, gens))
                new = ms_per_call(partial(sample, logits, params, gens))
                print(
                    f"{vocab:>7}  {shape:<7} {name:<22} {old:>9.2f} {new:>9.2f} {old / new:>7.1f}x"
                )


if __name__ == "__main__":
    main()
