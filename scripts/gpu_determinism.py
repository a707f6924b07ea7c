"""Deterministic mode on a GPU (issue 43, docs/DETERMINISM.md): does it hold, and what it costs.

`python scripts/gpu_determinism.py --out FILE` runs three stages on a random model of a real
shape (bench/gpu/workload.py, bfloat16), each recorded in FILE as it ends:

- kernels: a row's product through the batch-invariant kernel, and through torch's F.linear
  (cuBLAS, the control), in a batch of 1 and of 256 rows: how many of the 256 rows are bitwise
  equal; the same for the LM head's width, and for torch's and our log-softmax;
- answers: `--num-seqs` requests behind one `--prefix-len`-token system prompt, greedy, with
  their sampled tokens' log-probabilities: run with the prefix cache on, off, and the first
  `--alone` of them one at a time (max_num_seqs=1); how many answers (token ids and
  log-probability bits) agree with the cache-on run, in deterministic mode and, as the
  control, without it;
- throughput: nano-vllm's benchmark workload (bench/gpu/bench.py's, 256 sequences of 100..1024
  tokens in and out unless --bench-seqs says fewer), output tokens/s with and without the mode.

`--stages` picks stages (scripts/gpu_check.sh runs `answers` alone, with `--alone` equal to
`--num-seqs`: every request alone against all batched, the target 256/256) and `--no-control`
leaves out the runs without the mode. `--device cpu --quick` runs it all at toy sizes in
Triton's interpreter (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from bench.gpu.bench import run_kvcache  # noqa: E402
from bench.gpu.shared_prefix import make_shared_prefix_workload  # noqa: E402
from bench.gpu.workload import build_random_model, make_workload, vocab_size  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402


def equal_rows(alone: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """How many rows of x give the same bits computed in one batch and one row at a time."""
    batch = alone(x)
    return sum(int(torch.equal(alone(x[i : i + 1]), batch[i : i + 1])) for i in range(len(x)))


def kernels(device: str, hidden: int, vocab: int, rows: int) -> dict[str, Any]:
    from runner.backends.triton.batch_invariant import rows_log_softmax, rows_matmul

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (0.02 * torch.randn(3 * hidden, hidden, device=device)).to(dtype)
    head = (0.02 * torch.randn(vocab, hidden, device=device)).to(dtype)
    logits = torch.randn(rows, vocab, device=device) * 4
    report: dict[str, Any] = {
        "rows": rows,
        "rows_matmul_equal": equal_rows(lambda t: rows_matmul(t, w), x),
        "torch_linear_equal": equal_rows(lambda t: torch.nn.functional.linear(t, w), x),
        "rows_matmul_head_equal": equal_rows(lambda t: rows_matmul(t, head), x),
        "torch_head_equal": equal_rows(lambda t: torch.nn.functional.linear(t, head), x),
        "torch_log_softmax_equal": equal_rows(lambda t: torch.log_softmax(t, dim=-1), logits),
        "rows_log_softmax_equal": equal_rows(rows_log_softmax, logits),
    }
    ref = torch.nn.functional.linear(x.float(), w.float())
    report["rows_matmul_max_abs_err"] = float((rows_matmul(x, w).float() - ref).abs().max())
    return report


def answers_of(
    folder: Path, requests: list[BenchRequest], device: str, options: dict[str, Any]
) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """Each request's greedy tokens and their log-probabilities (as float.hex)."""
    from kvcache import LLM, SamplingParams

    llm = LLM(str(folder), device=device, **options)
    new = requests[0].max_tokens
    params = SamplingParams(max_tokens=new, temperature=0, logprobs=1, ignore_eos=True)
    outs = llm.generate([r.prompt_token_ids for r in requests], params)
    got = []
    for out in outs:
        sample = out.outputs[0]
        pairs = zip(sample.token_ids, sample.logprobs or [], strict=False)
        probs = tuple(p[t].logprob.hex() for t, p in pairs)
        got.append((tuple(sample.token_ids), probs))
    del llm
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return got


def answers(
    folder: Path,
    requests: list[BenchRequest],
    device: str,
    alone: int,
    base: dict[str, Any],
    control: bool = True,
) -> dict[str, Any]:
    report: dict[str, Any] = {"requests": len(requests), "alone": alone}
    for mode in (True, False) if control else (True,):
        options = base | {"deterministic": mode}
        start = time.perf_counter()
        cached = answers_of(folder, requests, device, options)
        uncached = answers_of(folder, requests, device, options | {"enable_prefix_caching": False})
        one = answers_of(folder, requests[:alone], device, options | {"max_num_seqs": 1})
        name = "deterministic" if mode else "default"
        report[name] = {
            "cache_off_equal": sum(a == b for a, b in zip(cached, uncached, strict=True)),
            "batch_1_equal": sum(a == b for a, b in zip(cached, one, strict=False)),
            "tokens_equal_cache_off": sum(
                a[0] == b[0] for a, b in zip(cached, uncached, strict=True)
            ),
            "wall_s": time.perf_counter() - start,
        }
    return report


def throughput(
    folder: Path, requests: list[BenchRequest], device: str, base: dict[str, Any]
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, mode in (("default", False), ("deterministic", True)):
        run = run_kvcache(folder, requests, device, base | {"deterministic": mode}, profile=False)
        report[name] = {k: run[k] for k in ("output_tok_s", "wall_s", "complete", "cuda_graphs")}
    report["cost"] = 1 - report["deterministic"]["output_tok_s"] / report["default"]["output_tok_s"]
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="toy sizes (a smoke test)")
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--alone", type=int, default=16, help="requests also run one at a time")
    p.add_argument("--bench-seqs", type=int, default=256, help="nano-vllm workload; 0: skip")
    p.add_argument(
        "--stages",
        nargs="+",
        choices=["kernels", "answers", "throughput"],
        default=["kernels", "answers", "throughput"],
    )
    p.add_argument("--no-control", action="store_true", help="no runs without the mode")
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.num_seqs, args.prefix_len, args.new_tokens = "tiny", 6, 40, 4
        args.alone, args.bench_seqs = 2, 4
    device = args.device
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}

    def stage(name: str, run: Callable[[], Any]) -> None:
        try:
            report[name] = run()
        except Exception as err:  # a broken stage keeps the others' figures
            report[name] = {"error": repr(err), "traceback": traceback.format_exc(limit=6)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"[{name}] {json.dumps(report[name], default=str)}", flush=True)

    vocab = vocab_size(args.shape)
    with tempfile.TemporaryDirectory(prefix="kvcache_determinism_") as tmp:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        folder = build_random_model(args.shape, Path(tmp) / args.shape, dtype, device)
        from transformers import AutoConfig

        hidden = int(AutoConfig.from_pretrained(folder).hidden_size)
        if "kernels" in args.stages:
            stage("kernels", lambda: kernels(device, hidden, vocab, 4 if args.quick else 256))
        base: dict[str, Any] = {"attention_backend": "triton", "block_size": 16}
        shared = make_shared_prefix_workload(
            args.num_seqs, args.prefix_len, (5, 50), args.new_tokens, (0, min(10000, vocab - 1))
        )
        control = not args.no_control
        if "answers" in args.stages:
            stage("answers", lambda: answers(folder, shared, device, args.alone, base, control))
        if args.bench_seqs and "throughput" in args.stages:
            top = 16 if args.quick else 1024
            tokens = (0, min(10000, vocab - 1))
            bench = make_workload(args.bench_seqs, 4 if args.quick else 100, top, top, tokens)
            bench_options = base | {"max_num_seqs": 256, "max_num_batched_tokens": 16384}
            stage("throughput", lambda: throughput(folder, bench, device, bench_options))
    return report


if __name__ == "__main__":
    main()
