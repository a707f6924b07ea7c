"""GPU throughput of the engine against transformers' continuous batching, on random weights.

`python -m bench.gpu.bench --out FILE` builds a randomly initialised model of a real shape
from its config (no download), saves it in bf16 and runs one workload through `kvcache.LLM` and
through transformers' `generate_batch` machinery in the same process. The workload mirrors
nano-vllm's published benchmark: 256 sequences, prompt and output lengths drawn uniformly from
100..1024 (seeded), prompt token ids from 0..10000, EOS ignored, Qwen3-0.6B shape. A small
greedy-equality check against transformers' unbatched `generate` on a tiny model runs last.
Results are printed and written as JSON after each phase, and a phase that fails records its
error and lets the next one run, so a run cut short or broken still leaves what it measured.
`--device cpu --quick` runs everything at toy sizes in seconds.

Each run's decode time is set beside its floor: the K/V and weight bytes it must read at the
device's bandwidth (`--bandwidth`, an H200's 4.8 TB/s by default; bench/gpu/floor.py).
`--workload shared-prefix` runs the shared-prefix workload instead (256 requests behind one
2,048-token system prompt, four ways: bench/gpu/shared_prefix.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu.floor import H200_BYTES_PER_S, ModelBytes, decode_floor, model_bytes
from bench.gpu.shared_prefix import (
    make_shared_prefix_workload,
    run_shared_prefix_ways,
    step_bytes_report,
)
from bench.gpu.step_profile import decode_step_profile, rms_norm_us
from bench.gpu.workload import (
    EOS_ID,
    SHAPES,
    build_random_model,
    make_workload,
    vocab_size,
)
from bench.hf_continuous import run_hf_continuous, sync_device
from bench.peers import load_hf_model, run_reference
from bench.workloads import BenchRequest
from runner.engine.api.interface import EngineInterface, StepRecord

# Everything is built locally; the GPU machine has no network, where a hub look-up only hangs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_kvcache(
    path: Path,
    requests: list[BenchRequest],
    device: str,
    options: dict[str, Any],
    prepare: Callable[[EngineInterface], Callable[[], None] | None] | None = None,
    keep_tokens: bool = False,
    profile: bool = True,
) -> dict[str, Any]:
    """Throughput of kvcache.LLM on the workload, EOS ignored, greedy; start-up excluded.
    `prepare(llm)` runs once the engine is built (a bench's choice of attention backend, its
    counters) and may return a call made as the timed run starts (after the warm-up);
    `keep_tokens` returns every request's output tokens; `profile` adds the step profile."""
    from kvcache import LLM, SamplingParams

    start = time.perf_counter()
    llm: EngineInterface = LLM(str(path), device=device, **options)
    startup = time.perf_counter() - start
    timed = prepare(llm) if prepare is not None else None
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    # Triton specialises an int argument on == 1 / divisible by 16 / neither, and the prefill
    # kernel's block-table row stride is the step's widest table: one prompt of each kind (1, 3
    # and 16 blocks), each in a call of its own, compiles all three variants before the clock
    # starts instead of in the timed run (about a second each on a cold Triton cache).
    block = llm.config.block_size
    for n in (5, 2 * block + 5, 16 * block):
        if n + warm.max_tokens <= llm.max_model_len:
            llm.generate([[5 + i % 100 for i in range(n)]] * 2, warm, cache_salt="warmup")
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests
    ]
    parts = llm.forward_parts()
    graphs = parts.decode_graphs
    replays_before = graphs.num_replays if graphs is not None else 0
    prefix_before = graphs.num_prefix_replays if graphs is not None else 0
    if timed is not None:
        timed()
    sync_device(device)
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params)
    sync_device(device)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    errors = [o.error for o in outs if o.error is not None]  # failed steps end requests early
    steps = [s for s in llm.recorded_steps() if s.t_start_s >= start - llm.metrics_t0]
    result = {
        "wall_s": wall,
        "startup_s": startup,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "complete": not errors and tokens == sum(r.max_tokens for r in requests),
        "errors": len(errors),
        "first_errors": errors[:3],
        "num_kv_blocks": llm.kv_pool().num_blocks,
        "attention_backend": parts.attention.name,
        # Whether decode graphs were captured, and how many timed steps replayed one.
        "cuda_graphs": graphs is not None,
        "cuda_graph_replays": (graphs.num_replays - replays_before) if graphs is not None else 0,
        # Of those, the steps that replayed the shared-prefix graph (a group read once).
        "cuda_graph_prefix_replays": (graphs.num_prefix_replays - prefix_before)
        if graphs is not None
        else 0,
        **step_times(steps),
        "model_bytes": model_bytes(path, kv_dtype(llm.kv_pool().dtype_name))._asdict(),
    }
    if keep_tokens:
        result["token_ids"] = [list(o.token_ids) for o in outs]
    if not profile:
        del llm, outs, graphs, parts
        _release(device)
        return result
    # A diagnostic, which must never cost the run its own figures: the run's median decode
    # batch at a context halfway through the median request.
    try:
        batch = max(1, int(result["decode_batch_median"]))
        prompts = sorted(len(r.prompt_token_ids) for r in requests)
        outputs = sorted(r.max_tokens for r in requests)
        context = prompts[len(prompts) // 2] + outputs[len(outputs) // 2] // 2
        context = min(context, llm.max_model_len - 20)
        result["step_profile"] = decode_step_profile(llm, batch, context, graphs)
    except Exception as err:
        result["step_profile_error"] = repr(err)
    if device.startswith("cuda"):  # one RMSNorm, torch's kernels against the Triton one
        try:
            model = parts.model
            heads = int(model.config.num_attention_heads)
            dtype = next(model.parameters()).dtype
            shape = (model.hidden_size, heads, model.head_dim, int(result["decode_batch_median"]))
            result["rms_norm_us"] = rms_norm_us(*shape, dtype=dtype)
        except Exception as err:
            result["rms_norm_error"] = repr(err)
    del llm, outs, graphs, parts
    _release(device)
    return result


def kv_dtype(name: str) -> torch.dtype:
    """The torch dtype a pool's `dtype_name` names ("bfloat16": torch.bfloat16)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} names no torch dtype")
    return dtype


def step_times(steps: list[StepRecord]) -> dict[str, Any]:
    """Where the timed run's wall time went, from the engine's per-step records: steps that only
    decode (their median time and batch, to set against the KV bytes a step reads) and steps
    that prefill."""
    decode = [s for s in steps if not s.num_prefill_tokens]
    prefill = [s for s in steps if s.num_prefill_tokens]

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2] if values else 0.0

    return {
        "decode_steps": len(decode),
        "decode_s": sum(s.duration_s for s in decode),
        "decode_step_ms_median": 1e3 * median([s.duration_s for s in decode]),
        "decode_batch_median": median([s.num_decode_tokens for s in decode]),
        "prefill_steps": len(prefill),
        "prefill_s": sum(s.duration_s for s in prefill),
    }


def check_greedy(folder: Path, device: str, num_prompts: int = 8) -> dict[str, Any]:
    """Greedy outputs of the engine (float32) equal transformers' unbatched generate, with
    every feature of a GPU step on: asynchronous scheduling, decode graphs, the fused kernels
    and shared-prefix attention. The prompts share a 48-token prefix (three blocks), so their
    decodes form a prefix group, and the group is read once wherever one forms (the graphs'
    and the eager backend's cost model set to ALWAYS); `shared_prefix_steps` says how many
    decode steps did."""
    from transformers import AutoModelForCausalLM

    from bench.gpu.shared_prefix import ExecutedReads, counted
    from kvcache import LLM, SamplingParams
    from runner.backends.triton.attention import triton_backend
    from runner.backends.triton.cascade_cost import ALWAYS

    prefix = 48
    requests = make_shared_prefix_workload(
        num_prompts, prefix, (3, 20), 16, (3, vocab_size("tiny") - 1), seed=1
    )
    hf: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = hf.to(device).eval()
    refs = run_reference(hf, requests, {EOS_ID}, device)
    del hf
    # A few blocks: sized from free memory, the pool of a tiny model would take most of the GPU.
    llm = LLM(
        str(folder),
        device=device,
        dtype="float32",
        attention_backend="triton",
        num_kv_blocks=512,
        block_size=16,
    )
    reads = ExecutedReads(prefix)
    reads.counting = True
    llm.attend_through(counted(triton_backend(ALWAYS), reads))
    graphs = llm.forward_parts().decode_graphs
    if graphs is not None:
        graphs.cascade = ALWAYS  # every group found is read once (the buffers permitting)
        graphs.step_listeners.append(reads.on_step)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0) for r in requests]
    outs = llm.generate([r.prompt_token_ids for r in requests], params)
    got = [o.token_ids for o in outs]
    features = {
        "async_scheduling": llm.config.overlaps_steps,
        "cuda_graphs": graphs is not None,
        "cuda_graph_prefix_replays": graphs.num_prefix_replays if graphs is not None else 0,
        "decode_steps": len(reads.steps),
        "shared_prefix_steps": sum(s[3] for s in reads.steps),
    }
    del llm
    _release(device)
    bad = [i for i, (a, b) in enumerate(zip(got, refs, strict=True)) if a != b]
    return {"prompts": len(requests), "equal": not bad, "mismatched_prompts": bad, **features}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny model and workload (smoke test)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--skip-hf", action="store_true", help="engine only (no ratio)")
    p.add_argument("--skip-check", action="store_true", help="no greedy-equality check")
    p.add_argument(
        "--check-only", action="store_true", help="only the float32 greedy-equality check"
    )
    p.add_argument(
        "--workload",
        choices=["nano-vllm", "shared-prefix"],
        default="nano-vllm",
        help="nano-vllm's benchmark (against transformers), or the shared-prefix workload run "
        "four ways (prefix cache off, on, on eagerly, on with shared-prefix attention)",
    )
    p.add_argument("--prefix-len", type=int, default=2048, help="shared-prefix: system prompt")
    p.add_argument("--own-len", type=int, nargs=2, default=[50, 200], metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, default=128, help="shared-prefix: tokens each")
    p.add_argument(
        "--bandwidth", type=float, default=H200_BYTES_PER_S, help="device bytes/s for the floor"
    )
    p.add_argument(
        "--hf-deadline-s",
        type=float,
        default=270.0,  # transformers took 244 s on an H200 (2026-11-30)
        help="stop transformers after this long (its running requests' tokens still count)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.num_seqs, args.min_len = "tiny", 4, 4
        args.max_input_len, args.max_output_len = 24, 12
        args.max_num_seqs, args.max_num_batched_tokens = 8, 64
        args.prefix_len, args.own_len, args.new_tokens = 32, [4, 8], 4
    return args


def _env(device: str) -> dict[str, Any]:
    import transformers
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__}
    env["transformers"] = transformers.__version__
    env["device"] = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = args.device
    report: dict[str, Any] = {
        "env": _env(device),
        "args": {k: str(v) for k, v in vars(args).items()},
    }

    def phase(stage: str, run: Callable[[], Any]) -> None:
        """Run one phase into report[stage] and save; a failure is recorded, not raised."""
        try:
            report[stage] = run()
        except Exception as err:  # one broken phase must not cost the others their figures
            report[stage] = {"error": repr(err), "traceback": traceback.format_exc(limit=6)}
            _release(device)
        save()
        print(f"[{stage}] {json.dumps(report.get(stage), default=str)}", flush=True)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))

    with tempfile.TemporaryDirectory(prefix="kvcache_gpu_bench_") as tmp:
        if args.check_only:
            phase("correctness", lambda: check_greedy(_tiny_model(Path(tmp) / "tiny"), device))
            return report
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        folder = build_random_model(args.shape, Path(tmp) / args.shape, dtype, device)
        vocab = vocab_size(args.shape)
        options = {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "attention_backend": "triton" if device.startswith("cuda") else None,
        }
        if args.workload == "shared-prefix":
            shared = make_shared_prefix_workload(
                args.num_seqs,
                args.prefix_len,
                (args.own_len[0], args.own_len[1]),
                args.new_tokens,
                (0, min(10000, vocab - 1)),
                args.seed,
            )
            phase("workload", lambda: _workload_summary(args.shape, shared))
            report["shared_prefix"] = {}

            def on_way(name: str, figures: dict[str, Any]) -> None:  # saved as each way ends
                report["shared_prefix"][name] = figures
                save()

            phase(
                "shared_prefix",
                lambda: _shared_prefix(folder, shared, device, options, dtype, args, on_way),
            )
            return report
        requests = make_workload(
            args.num_seqs,
            args.min_len,
            args.max_input_len,
            args.max_output_len,
            (0, min(10000, vocab - 1)),
            args.seed,
        )
        phase("workload", lambda: _workload_summary(args.shape, requests))
        phase("kvcache", lambda: run_kvcache(folder, requests, device, options))
        phase("decode_floor", lambda: _floor(report["kvcache"], requests, args.bandwidth))
        if not args.skip_hf:
            phase("hf_generate_batch", lambda: _run_hf(folder, requests, device, args))
            phase("ratio", lambda: _ratio(report))
        if not args.skip_check:
            tiny = Path(tmp) / "tiny"
            phase("correctness", lambda: check_greedy(_tiny_model(tiny), device))
    return report


def _floor(
    result: dict[str, Any], requests: list[BenchRequest], bytes_per_s: float
) -> dict[str, Any]:
    """The run's decode time beside the floor its K/V and weight bytes set."""
    sizes = ModelBytes(**result["model_bytes"])
    floor = decode_floor(requests, sizes, int(result["decode_steps"]), bytes_per_s)
    return {
        **floor,
        "decode_s": result["decode_s"],
        "over_floor": result["decode_s"] / floor["floor_s"],
    }


def _shared_prefix(
    folder: Path,
    requests: list[BenchRequest],
    device: str,
    options: dict[str, Any],
    dtype: torch.dtype,
    args: argparse.Namespace,
    on_way: Callable[[str, dict[str, Any]], None],
) -> dict[str, Any]:
    """The shared-prefix workload four ways (each handed to `on_way` as it ends), and the bytes
    one decode step reads both ways."""
    block = 16  # the engine's default block size, which the bench keeps
    shared_tokens = args.prefix_len // block * block
    ways = run_shared_prefix_ways(
        run_kvcache,
        folder,
        requests,
        device,
        options,
        args.bandwidth,
        args.quick,
        shared_tokens,
        on_way,
    )
    sized = next((w["model_bytes"] for w in ways.values() if "model_bytes" in w), None)
    if sized is not None:
        sizes = ModelBytes(**sized)
        ways["step_bytes"] = step_bytes_report(
            requests, args.prefix_len, sizes, block, dtype, args.bandwidth
        )
    return ways


def _workload_summary(shape: str, requests: list[BenchRequest]) -> dict[str, Any]:
    return {
        "shape": shape,
        "num_seqs": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
    }


def _run_hf(
    folder: Path, requests: list[BenchRequest], device: str, args: argparse.Namespace
) -> dict[str, Any]:
    hf = load_hf_model(folder, device)
    try:
        return run_hf_continuous(hf, requests, device, args.hf_deadline_s)
    finally:
        del hf
        _release(device)


def _ratio(report: dict[str, Any]) -> dict[str, Any]:
    """kvcache over transformers, output tokens/s. Our run must be complete. transformers'
    either completed too, or was stopped at its deadline with its running requests' tokens
    counted: then its rate is that of its first `wall_s` seconds, without the tail where few
    requests are left and each step yields fewer tokens, which favours transformers."""
    ours, theirs = report.get("kvcache", {}), report.get("hf_generate_batch", {})
    cut_short = not theirs.get("complete") and theirs.get("in_flight_tokens") is not None
    counted = theirs.get("complete") or (cut_short and theirs.get("output_tokens", 0) > 0)
    if not (ours.get("complete") and counted) or theirs.get("errors"):
        return {"kvcache_over_hf": None, "why": "a run failed or did not finish (see above)"}
    ratio = ours["output_tok_s"] / theirs["output_tok_s"]
    basis = (
        f"transformers' first {theirs['wall_s']:.0f} s (stopped at its deadline; its tail "
        "left out, which favours it)"
        if cut_short
        else "both runs complete"
    )
    return {"kvcache_over_hf": ratio, "target": 5.0, "meets": ratio >= 5.0, "basis": basis}


def _tiny_model(folder: Path) -> Path:
    return build_random_model("tiny", folder, torch.float32, "cpu")


if __name__ == "__main__":
    main()
