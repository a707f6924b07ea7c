"""`kvcache bench`: one workload through several systems in one process, one table."""

from __future__ import annotations

import functools
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from bench.background_load import background_load, load_note
from bench.beams import hf_beam_options, run_engine_beams
from bench.engine_options import EngineOptions
from bench.external import EXTERNAL_SYSTEMS, PeerPaths, matching_tokens, run_external
from bench.hf_continuous import run_hf_cb
from bench.matmul_timer import MatmulTimer
from bench.peers import (
    PeerResult,
    Sampling,
    cut_output,
    load_hf_model,
    run_hf_lookup,
    run_hf_static,
    run_reference,
    samples_per_prompt,
)
from bench.systems import ENGINE_SYSTEMS, check_systems
from bench.table import BenchRow, EngineFigures, format_table
from bench.workloads import BenchRequest, load_workload
from runner.backends.cpu.linear import PackedLinear, onednn_available
from runner.backends.cpu.loader import load_cpu_kernels
from runner.engine.api.interface import EngineInterface
from runner.engine.api.llm import LLM
from runner.engine.requests.outputs import RequestOutput
from runner.sampling.params import SamplingParams

if TYPE_CHECKING:
    from transformers import GenerationMixin


class BenchReport(TypedDict):
    """What `kvcache bench` prints and writes: a row per system, the table, the peak."""

    rows: list[BenchRow]
    table: str
    peak_gflops: float


def matmul_peak_gflops(device: str, size: int = 1024, repeats: int = 24) -> float:
    """A float32 matrix-product peak measured now, the denominator of model-FLOP utilisation:
    the fastest of a plain product and, on the CPU, each packed one the engine can use."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    products = [lambda: torch.mm(a, b)]
    if device == "cpu":
        packings = [PackedLinear(b, None, panel_kernel=False)] if onednn_available() else []
        if load_cpu_kernels() is not None:
            packings.append(PackedLinear(b, None))
        products.extend(functools.partial(packed, a) for packed in packings)
    best = float("inf")
    for product in products:
        product()
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def run_engine(
    model: str | None,
    requests: list[BenchRequest],
    device: str,
    options: EngineOptions,
    sampling: Sampling | None = None,
) -> tuple[PeerResult, EngineInterface, EngineFigures]:
    llm: EngineInterface = LLM(model, device=device, **options)
    # Warm up the kernels on a prompt that shares nothing with the workload (its own salt).
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2, temperature=0), cache_salt="w")
    first_step = len(llm.recorded_steps())
    before = llm.cache_stats()
    parts = llm.forward_parts()
    timer = MatmulTimer(parts.model, parts.cpu_layers) if device == "cpu" else None
    matmul_s: dict[int, float] = {}  # recorded step index -> seconds inside products
    start = time.perf_counter()
    outs = _run_with_arrivals(llm, requests, timer, matmul_s, sampling, first_step)
    wall = time.perf_counter() - start
    if timer is not None:
        timer.close()
    steps = llm.recorded_steps(first_step)
    after = llm.cache_stats()
    query = after.query_tokens - before.query_tokens
    hits = after.hit_tokens - before.hit_tokens
    prefill = sum(s.num_prefill_tokens for s in steps)
    # Every sample of every request (one each unless the run asks for several), with its request.
    samples = [(sample, r) for o, r in zip(outs, requests, strict=True) for sample in o.outputs]
    ttft = [t for s, _ in samples if isinstance(t := s.metrics.get("ttft_s"), float)]
    pure_prefill = [s for s in steps if s.num_decode_tokens == 0 and s.num_prefill_tokens]
    extra: EngineFigures = {
        "hit_rate": hits / query if query else 0.0,
        "prefill_only_tokens": sum(s.num_prefill_tokens for s in pure_prefill),
        "prefill_only_s": sum(s.duration_s for s in pure_prefill),
        "preemptions": llm.queue_depth().preemptions,
        "kv_pool_mib": llm.kv_pool().nbytes / 2**20,
    }
    decode = [
        (i, s)
        for i, s in enumerate(steps, start=first_step)
        if s.num_prefill_tokens == 0 and s.num_decode_tokens
    ]
    decode_s = sum(s.duration_s for _, s in decode)
    if timer is not None and decode_s > 0:
        inside = sum(matmul_s.get(i, 0.0) for i, _ in decode)
        extra["decode_outside_matmul"] = 1 - inside / decode_s
    # Inter-token latency of the requests present from the start (the running decodes).
    itl = [
        x for s, r in samples if not r.arrive_after_steps for x in _floats(s.metrics.get("itl_s"))
    ]
    extra["itl_p50_ms"] = _ms(_percentile(itl, 0.5))
    extra["itl_p99_ms"] = _ms(_percentile(itl, 0.99))
    outputs = [list(sample.token_ids) for sample, _ in samples]
    return PeerResult(outputs, wall, prefill, ttft), llm, extra


def _run_with_arrivals(
    llm: EngineInterface,
    requests: list[BenchRequest],
    timer: MatmulTimer | None,
    matmul_s: dict[int, float],
    sampling: Sampling | None,
    recorded: int,
) -> list[RequestOutput]:
    """Submit each request at its arrival step and run to the end; outputs in input order.
    With a timer, `matmul_s` gets each recorded step's seconds inside matrix products (the
    engine has `recorded` steps recorded before). Sampled requests are seeded by their index,
    so a run repeats itself."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrive_after_steps)
    done: dict[str, RequestOutput] = {}
    steps = 0
    while pending or llm.has_unfinished():
        while pending and requests[pending[0]].arrive_after_steps <= steps:
            index = pending.pop(0)
            req = requests[index]
            params = SamplingParams(
                max_tokens=req.max_tokens,
                temperature=sampling.temperature if sampling else 0,
                top_p=sampling.top_p if sampling else 1.0,
                seed=index if sampling else None,
                ignore_eos=req.ignore_eos,
                n=samples_per_prompt(sampling),
            )
            llm.add_request(req.prompt_token_ids, params, request_id=req.request_id)
        before = timer.total_s if timer is not None else 0.0
        for out in llm.step():
            done[out.request_id] = out
        new = len(llm.recorded_steps(recorded))
        recorded += new
        if timer is not None and new:
            matmul_s[recorded - 1] = timer.total_s - before
        steps += 1
    return [done[r.request_id] for r in requests]


def _floats(value: object) -> list[float]:
    """A sample's recorded list of seconds (its inter-token gaps); [] where none was recorded."""
    return [x for x in value if isinstance(x, float)] if isinstance(value, list) else []


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


def _probe(
    model: str | None, device: str, workload: str, max_tokens: int | None, limit: int | None
) -> tuple[list[BenchRequest], set[int], Path, int]:
    """The workload's requests in the model's tokens, its EOS ids, its folder and its
    parameters in a prompt token's matrix products, read from a small engine."""
    probe: EngineInterface = LLM(model, device=device, num_kv_blocks=16)
    requests = load_workload(workload, probe.tokenizer, max_tokens, limit)
    return requests, set(probe.eos_ids), probe.model_path, _matmul_params(probe)


def _matmul_params(llm: EngineInterface) -> int:
    """Parameters in a prompt token's matrix products: the projections. The head is left out:
    a prompt runs it for its last token only (counting it for every token overstated prefill
    FLOPs by a fifth for the default model)."""
    return llm.forward_parts().model.num_matmul_params(include_head=False)


def run_bench(
    workload: str,
    systems: list[str],
    model: str | None = None,
    max_tokens: int | None = None,
    limit: int | None = None,
    device: str = "cpu",
    check: bool = True,
    engine_options: EngineOptions | None = None,
    sampling: Sampling | None = None,
    beam_width: int | None = None,
    peer_paths: PeerPaths | None = None,
    background: int = 0,
) -> BenchReport:
    """Returns {"rows": [...], "table": str}; ratios are against hf-static of this run. With
    `sampling`, every system samples and nothing is checked (no two samplers agree); with
    `beam_width`, every system searches beams (bench/beams.py); `background` processes
    spin while the systems run (bench/background_load.py)."""
    check = check and sampling is None
    check_systems(systems, sampling is not None, beam_width)
    peak = matmul_peak_gflops(device)
    requests, eos_ids, model_dir, matmul_params = _probe(model, device, workload, max_tokens, limit)
    hf_model = (
        load_hf_model(model_dir, device)
        if check or any(s.startswith("hf-") for s in systems)
        else None
    )
    race = Race(
        model, model_dir, requests, eos_ids, device, engine_options or {}, sampling, beam_width,
        hf_model, matmul_params, peak, peer_paths or PeerPaths(),
    )  # fmt: skip
    beams = hf_beam_options(beam_width)
    reference = run_reference(_hf(hf_model), requests, eos_ids, device, **beams) if check else None
    rows: list[BenchRow] = []
    engine_samples: dict[str, list[list[int]]] = {}  # sampled outputs of float32 engines
    skipped: list[str] = []  # a line for each external peer that is not installed
    with background_load(background):
        for system in systems:
            ran = race.run_system(system)
            if isinstance(ran, str):
                skipped.append(ran)
                continue
            result, extra, same_model = ran
            outputs = race.answers(result)
            if reference and system in EXTERNAL_SYSTEMS:  # float differences: count the tokens
                extra["matching_tokens"] = matching_tokens(outputs, reference)
                extra["reference_tokens"] = sum(len(o) for o in reference)
            if system in ENGINE_SYSTEMS and same_model and sampling is not None:
                engine_samples[system] = outputs
            matches = outputs == reference if reference and same_model else None
            rows.append(_row(system, workload, len(requests), result, outputs, matches, extra))
    base = next((r for r in rows if r["system"] == "hf-static"), None)
    for row in rows:
        row["vs_hf_static"] = row["output_tok_s"] / base["output_tok_s"] if base else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    table = format_table(rows, peak, rss) + load_note(background)
    table += "".join(f"\n{line}" for line in skipped)
    table += _notes(sampling, beam_width, engine_samples)
    return {"rows": rows, "table": table, "peak_gflops": peak}


@dataclass(frozen=True)
class Race:
    """What every system of one run shares: the model, the requests, how each is run."""

    model: str | None
    model_dir: Path
    requests: list[BenchRequest]
    eos_ids: set[int]
    device: str
    engine_options: EngineOptions  # the command line's, under each engine system's own
    sampling: Sampling | None
    beam_width: int | None
    hf_model: GenerationMixin | None
    matmul_params: int  # in a prompt token's matrix products
    peak_gflops: float  # the matrix products' measured peak
    peer_paths: PeerPaths

    def run_system(self, system: str) -> tuple[PeerResult, EngineFigures, bool] | str:
        """`system` run over the requests: its result, its engine figures, and whether it
        runs the reference's weights (False: other weights, so no exact match is asked); or
        the line saying an external peer is not installed."""
        hf, requests, eos_ids = self.hf_model, self.requests, self.eos_ids
        if system in ENGINE_SYSTEMS:
            return self.run_engine_system(system)
        if system == "hf-static":
            batch = self.engine_options.get("max_num_seqs") or len(requests)
            beams = hf_beam_options(self.beam_width)
            result = run_hf_static(
                _hf(hf), requests, eos_ids, self.device, batch, self.sampling, beams
            )
        elif system == "hf-lookup":
            result = run_hf_lookup(_hf(hf), requests, eos_ids, self.device)
        elif system in EXTERNAL_SYSTEMS:
            ran = run_external(
                system, self.model, self.model_dir, requests, eos_ids, self.peer_paths
            )
            if isinstance(ran, str):
                return ran
            result = ran
        else:
            result = run_hf_cb(_hf(hf), requests, eos_ids, sampling=self.sampling)
        return result, {}, True

    def answers(self, result: PeerResult) -> list[list[int]]:
        """Each sample's tokens, cut where its request stops (its EOS, its max_tokens)."""
        samples = [r for r in self.requests for _ in range(samples_per_prompt(self.sampling))]
        return [
            cut_output(o, self.eos_ids, r) for o, r in zip(result.outputs, samples, strict=True)
        ]

    def run_engine_system(self, system: str) -> tuple[PeerResult, EngineFigures, bool]:
        """One of the engine's systems, with its prefill's model-FLOP utilisation."""
        options: EngineOptions = {**self.engine_options, **ENGINE_SYSTEMS[system]}
        same_model = (
            options.get("cpu_weight_dtype", "float32") == "float32"
            and options.get("kv_cache_dtype", "auto") == "auto"
        )
        if self.beam_width:
            result = run_engine_beams(
                self.model, self.requests, self.device, options, self.beam_width
            )
            return result, {}, same_model
        result, llm, extra = run_engine(
            self.model, self.requests, self.device, options, self.sampling
        )
        if extra["prefill_only_s"] > 0:
            flops = 2 * self.matmul_params * extra["prefill_only_tokens"]
            extra["prefill_mfu"] = flops / extra["prefill_only_s"] / (self.peak_gflops * 1e9)
        del llm
        return result, extra, same_model


def _row(
    system: str,
    workload: str,
    requests: int,
    result: PeerResult,
    outputs: list[list[int]],
    matches: bool | None,
    extra: EngineFigures,
) -> BenchRow:
    """One system's row of the table."""
    out_tokens = sum(len(o) for o in outputs)
    return {
        "system": system,
        "workload": workload,
        "requests": requests,
        "wall_s": result.wall_s,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / result.wall_s,
        "prefill_tokens": result.prefill_tokens,
        "ttft_p50_ms": _ms(_percentile(result.ttft_s, 0.5)),
        "ttft_p99_ms": _ms(_percentile(result.ttft_s, 0.99)),
        "matches_reference": matches,
        **extra,
    }


def _notes(
    sampling: Sampling | None, beam_width: int | None, engine_samples: dict[str, list[list[int]]]
) -> str:
    """The table's closing lines on how every system sampled or searched."""
    notes = ""
    if sampling is not None:
        notes += (
            f"\nevery system sampled: temperature {sampling.temperature}, top_p {sampling.top_p}"
        )
        if sampling.n > 1:
            notes += f", {sampling.n} samples a prompt"
        notes += _same_samples(engine_samples)
    if beam_width:
        notes += f"\nevery system searched {beam_width} beams a prompt; its best is its answer"
    return notes


def _hf(model: GenerationMixin | None) -> GenerationMixin:
    assert model is not None  # loaded whenever a check or an hf- system asks for it
    return model


def _same_samples(samples: dict[str, list[list[int]]]) -> str:
    """How many answers each float32 engine sampled exactly as the first one did. Each
    request is seeded by its index, and a seeded request draws the same numbers whatever its
    batch, cache or guesses; only rounding differs (a step of one row rounds otherwise than a
    longer one, by about 1e-5 in the logits), which sends a draw that close to the edge
    between two tokens the other way."""
    if len(samples) < 2:
        return ""
    first, *others = samples
    counts = [
        f"{s} {sum(a == b for a, b in zip(samples[s], samples[first], strict=True))} of "
        f"{len(samples[first])}"
        for s in others
    ]
    return f"\nanswers sampled exactly as {first}'s: {', '.join(counts)}"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
