"""Where an engine step's time goes on a GPU, measured after the GPU bench's timed run: the
decode graph replayed alone (its GPU time, and its top kernels), and a few whole decode steps
under torch's profiler (the host's operations and every kernel, inside the graph or not). Set
against the run's step time, they split a step into GPU work, host work and what is between.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from runner.engine.api.interface import EngineInterface
from runner.engine.requests.outputs import RequestOutput

if TYPE_CHECKING:
    from runner.model.cuda_graphs import DecodeGraphs


def graph_replay_ms(graphs: DecodeGraphs, batch_size: int, repeats: int = 20) -> dict[str, Any]:
    """GPU time of one decode step alone: the graph that a batch of `batch_size` rows runs,
    replayed `repeats` times back to back over the inputs of the step that ran last (which
    must be a decode step of `batch_size` rows through that graph: its rows past the batch are
    padding then). Each replay writes the same K/V into the same slots as that step did."""
    size = graphs.graph_size(batch_size)
    graph = graphs.graphs[size]
    graph.replay()  # warm: the first replay after the run may pay for clocks and caches
    return {"graph_batch_size": size, "graph_replay_ms": replay_ms(graph, repeats)}


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 1) -> float:
    """GPU milliseconds of one replay of `graph`, over `repeats` back to back (CUDA events)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeats


def ranked(events: Any, key: Callable[[Any], float], calls: int, top: int) -> list[dict[str, Any]]:
    """The `top` profiler events by `key` (microseconds), each as name, ms and count per call
    of what was profiled `calls` times."""
    chosen = sorted((e for e in events if key(e) > 0), key=key, reverse=True)[:top]
    return [
        {"name": e.key[:100], "ms": key(e) / 1e3 / calls, "calls": e.count / calls} for e in chosen
    ]


def top_kernels(run: Callable[[], Any], repeats: int, top: int = 8) -> list[dict[str, Any]]:
    """The GPU kernels that take the most time in `run()` (a graph replay), by torch's
    profiler: name, ms and launches (`calls`) per call. Where the next speed-up of a step is."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    return ranked(prof.key_averages(), lambda e: e.self_device_time_total, repeats, top)


def decode_step_profile(
    llm: EngineInterface,
    num_seqs: int,
    prompt_len: int,
    graphs: DecodeGraphs | None = None,
    steps: int = 12,
    top: int = 10,
) -> dict[str, Any]:
    """`steps` decode steps of `num_seqs` sequences (prompts of `prompt_len` tokens, already
    prefilled) under torch's profiler: wall ms a step, and the operations that take the most
    host time (self CPU time) and the kernels that take the most GPU time, a step each. The
    profiler slows the host down; its split, not its totals, is the figure. With the engine's
    decode `graphs`, then the last step's graph replayed alone (graph_replay_ms), and its top
    kernels: the step's GPU work, to set against its wall time."""
    from torch.profiler import ProfilerActivity, profile

    from kvcache import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    vocab = min(1000, int(llm.forward_parts().model.vocab_size))
    for i in range(num_seqs):
        prompt = [(5 + i * 31 + j * 7) % vocab for j in range(prompt_len)]
        llm.add_request(prompt, params, request_id=f"profile-{i}", cache_salt="profile")
    finished: list[RequestOutput] = []
    for _ in range(64):  # prefill, until a step only decodes
        finished += llm.step()
        last = llm.recorded_steps(-1)
        if last and not last[0].num_prefill_tokens:
            break
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            finished += llm.step()
        wall = time.perf_counter() - start
    replay: dict[str, Any] = {}
    if graphs is not None and graphs.use_graphs and graphs.can_run(num_seqs, 1):
        replay = graph_replay_ms(graphs, num_seqs)
        graph = graphs.graphs[replay["graph_batch_size"]]
        replay["graph_top_kernels"] = top_kernels(graph.replay, repeats=5)
    while llm.has_unfinished():  # the rest, so the engine is left empty
        finished += llm.step()
    events = prof.key_averages()
    return {
        "num_seqs": num_seqs,
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        # The host's time inside torch's operations (launches, copies, waits for the GPU
        # included); the rest of the wall time is Python: scheduling, bookkeeping.
        "host_ops_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1e3 / steps,
        "host_top": ranked(events, lambda e: e.self_cpu_time_total, steps, top),
        "gpu_top": (
            ranked(events, lambda e: e.self_device_time_total, steps, top)
            if len(activities) > 1
            else []
        ),
        "requests_finished": len(finished),
        **replay,
    }


def rms_norm_us(
    hidden: int, heads: int, head_dim: int, rows: int, dtype: torch.dtype, repeats: int = 50
) -> dict[str, float]:
    """GPU microseconds of one RMSNorm by the torch path and by the Triton kernel, over a
    hidden state [rows, hidden] and over per-head rows [rows, heads, head_dim] (Qwen3's q
    norm), each as `repeats` norms captured in a CUDA graph: launches cost what they cost in a
    decode graph. The model's own weights are not needed: a norm's cost is its shape's."""
    from runner.backends.triton.rms_norm import rms_norm
    from runner.model.layers import RMSNorm

    timings: dict[str, float] = {}
    for name, shape in (("hidden", (rows, hidden)), ("heads", (rows, heads, head_dim))):
        norm = RMSNorm(shape[-1]).to(device="cuda", dtype=dtype)
        x = torch.randn(shape, device="cuda", dtype=dtype)

        def triton_path(t: torch.Tensor, n: RMSNorm = norm) -> torch.Tensor:
            return rms_norm(t, n.scale(), n.eps, False)

        paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "torch": norm.torch_path,
            "triton": triton_path,
        }
        for path, run in paths.items():
            run(x)  # compiles the Triton kernel, sets up the allocator, off the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(repeats):
                    run(x)
            graph.replay()
            timings[f"{name}_{path}_us"] = 1e3 * replay_ms(graph) / repeats
    return timings
