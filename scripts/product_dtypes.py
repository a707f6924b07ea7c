"""One packed product per `cpu_weight_dtype`, on one thread, against float32: the
prefill-shaped products (16 to 512 rows) of the default model's widths and one decode row.

    python scripts/product_dtypes.py [--rows 1,16,64,256,512]

Times are the thread's CPU time (time.thread_time), the best of 5 rounds with the dtypes
interleaved, so other processes on a shared machine change them little; the ratios are
float32's time over each dtype's (above 1: faster).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.backends.cpu.linear import PackedLinear  # noqa: E402
from runner.backends.cpu.loader import load_cpu_kernels  # noqa: E402

SHAPES = ((576, 960), (576, 3072), (1536, 576))  # (K, N): qkv, gate_up, down of SmolLM2-135M


def products(weight: torch.Tensor) -> dict[str, PackedLinear]:
    kernels = load_cpu_kernels()
    out = {
        "float32": PackedLinear(weight, None),
        "bfloat16": PackedLinear(weight, None, weight_dtype=torch.bfloat16),
        "int8": PackedLinear(weight, None, weight_dtype=torch.int8),
    }
    if kernels is not None and kernels.has_pairs:
        out["bfloat16-dot"] = PackedLinear(weight, None, bfloat16_dot=True)
    if kernels is not None and kernels.has_quads:
        out["int8-dot"] = PackedLinear(weight, None, int8_dot=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256,512")
    args = parser.parse_args()
    if load_cpu_kernels() is None:
        sys.exit("the CPU kernels do not build here: nothing to compare")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        for k, n in SHAPES:
            x = torch.randn(rows, k)
            timed = products(torch.randn(n, k))
            best = dict.fromkeys(timed, float("inf"))
            reps = max(1, 2000 // rows)
            for _ in range(5):
                for name, product in timed.items():
                    product(x)
                    start = time.thread_time()
                    for _ in range(reps):
                        product(x)
                    best[name] = min(best[name], (time.thread_time() - start) / reps)
            base = best["float32"]
            others = [(name, t) for name, t in best.items() if name != "float32"]
            rates = " ".join(f"{name} {base / t:.2f}x" for name, t in others)
            gflops = 2 * rows * k * n / base / 1e9
            print(f"rows {rows:4d} K {k:4d} N {n:4d}: float32 {gflops:5.0f} GF/s | {rates}")


if __name__ == "__main__":
    main()
