"""`kvcache bench --workload pd_interference --systems engine,engine-nochunk,engine-pd`: the stall
a long prompt's prefill puts on running decodes, with and without disaggregation.

Every system is served (real processes on loopback) and driven the same way, by streamed
requests sent at their workload arrival times (data/pd_interference.jsonl: a few long decodes at
t=0, long prompts arriving while they run). engine and engine-nochunk are one colocated `kvcache
serve` on every CPU this process may use (chunked prefill on / off); engine-pd is a prefill
worker on the first CPU, a decode worker on the second (ZeroMQ handover) and the router;
engine-pd-alone, the same given the decodes only (the ITL floor, in the same run);
engine-pd-redis, engine-pd handing over through a redis-server of its own. The
router and this client run on the prefill worker's CPU: every streamed chunk passes through them,
and on the decode worker's CPU they would take its steps' time. (Its pulls stay there: a pull's
thread on the busy prefill CPU, preempted while it held the interpreter's lock, made the decode
steps 3x slower.) Per system: the decodes'
inter-token latency p50 / p99 / max while the long prompts arrive and run (the gaps between
their stream chunks from the first long prompt's arrival on: before it the decodes' own start
runs, their prompts joining the batch and their handovers' bookkeeping, a start-up the long
prompts have no part in), the long prompts' TTFT, total throughput, the KV bytes and
milliseconds handed over (the milliseconds a handover adds after its prefill's end: the rest
runs beside the prefill), whether every output equals the first system's (greedy), each stream's
token times (for the picture: scripts/pd_streams.py), and for engine-pd both workers' recorded
schedules (``pd_metrics``, what `kvcache report` draws on one timeline)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import httpx

from bench.engine_options import EngineOptions
from bench.local_process import free_port, stop
from bench.local_redis import AUTO
from bench.local_redis import redis_url as local_redis
from bench.pd_results import Stream, SystemResult, WorkloadRow
from bench.workloads import workload_path
from runner.disagg.cpus import thread_on_cpus

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS: dict[str, EngineOptions] = {
    "engine": {},
    "engine-nochunk": {"enable_chunked_prefill": False},
    "engine-pd": {},
    # engine-pd given the decodes alone, no long prompt: what its ITL p99 / p50 is with nothing
    # to disturb it, on this machine, in this run (the floor engine-pd's ratio is held to).
    "engine-pd-alone": {},
    # engine-pd handing over through a Redis server of its own (redis-server on the PATH).
    "engine-pd-redis": {},
}
START_TIMEOUT_S = 300.0


def _wait_healthy(process: subprocess.Popen[bytes], url: str, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the {what} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {what} did not start")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


@contextmanager
def _process(args: list[str], what: str) -> Iterator[str]:
    """A server process started with ``args`` plus --port; its URL once /health is ok."""
    port = free_port()
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([*args, "--port", str(port)], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, url, what)
        yield url
    finally:
        stop(process, 30)


def _worker(
    model: str | None, role: str, cpus: str, options: EngineOptions, handover: str = "zmq"
) -> AbstractContextManager[str]:
    args = [sys.executable, "-m", "bench.pd_interference_worker", "--role", role, "--cpus", cpus]
    args += ["--options", json.dumps(options), "--handover", handover]
    args += ["--model", model] if model else []
    return _process(args, f"{role} worker")


@contextmanager
def _system(name: str, model: str | None, cpus: list[int]) -> Iterator[dict[str, str]]:
    """The URLs: "url" (where requests go), and for engine-pd "prefill" and "decode"."""
    if not name.startswith("engine-pd"):
        every = ",".join(str(c) for c in cpus)
        with _worker(model, "both", every, SYSTEMS[name]) as url:
            yield {"url": url}
        return
    first, second = str(cpus[0]), str(cpus[1 % len(cpus)])
    with ExitStack() as stack:
        with thread_on_cpus({cpus[0]}):  # Redis on the prefill worker's CPU, as the router
            redis = stack.enter_context(local_redis(AUTO if name == "engine-pd-redis" else None))
        yield stack.enter_context(_pd_pair(model, first, second, redis or "zmq"))


@contextmanager
def _pd_pair(model: str | None, first: str, second: str, handover: str) -> Iterator[dict[str, str]]:
    """A prefill worker on CPU ``first``, a decode worker on ``second``, and the router."""
    record: EngineOptions = {"record_metrics": True}  # both schedules, for the report's two lanes
    with (
        _worker(model, "prefill", first, record, handover) as prefill,
        _worker(model, "decode", second, record, handover) as d,
    ):
        # The router on the prefill worker's CPU (as `taskset -c 0 kvcache router ...`).
        code = f"import os, cli; os.sched_setaffinity(0, {{{first}}}); cli.main()"
        router = [sys.executable, "-c", code, "router"]
        with _process([*router, "--prefill", prefill, "--decode", d], "router") as url:
            yield {"url": url, "prefill": prefill, "decode": d}


async def _one(client: httpx.AsyncClient, url: str, row: WorkloadRow, t0: float) -> Stream:
    """Send one request at its arrival time; the times its stream chunks arrived."""
    await asyncio.sleep(max(0.0, t0 + float(row.get("arrival_s", 0.0)) - time.perf_counter()))
    body = {"prompt": row["prompt"], "max_tokens": row["max_tokens"], "temperature": 0}
    body |= {"stream": True, "ignore_eos": bool(row.get("ignore_eos", False))}
    sent = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{row['id']}: {chunk['error']}")
            for choice in chunk.get("choices", []):
                # One chunk a step's token, its text empty while the detokenizer holds it back
                # (a character not whole yet): still a token that came, so a time; skipping it
                # made the next gap two steps long.
                times.append(time.perf_counter())
                text.append(choice.get("text") or "")
    return {"id": row["id"], "kind": row.get("kind", "decode"), "sent": sent, "times": times,
            "text": "".join(text)}  # fmt: skip


async def _drive(url: str, rows: list[WorkloadRow]) -> tuple[list[Stream], float, float]:
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        # Warm-up as the run goes: one whole answer, then three streamed at once, so the run
        # is never the servers' first streamed chunks or first batch of three.
        warm = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        (await client.post(f"{url}/v1/completions", json=warm)).raise_for_status()
        streamed: list[WorkloadRow] = [
            {"id": f"warm-{i}", "prompt": f"Hello {i}", "max_tokens": 16} for i in range(3)
        ]
        await asyncio.gather(*(_one(client, url, row, time.perf_counter()) for row in streamed))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, row, t0) for row in rows))
        return list(results), time.perf_counter() - t0, t0


def decode_gaps_ms(results: list[Stream], since: float = 0.0) -> list[float]:
    """The decodes' inter-token gaps (ms) that start once every decode has its first token and
    at or after ``since`` (the first long prompt's arrival: the ITL while the long prompts
    arrive and run). The gaps before are the decodes' own start (one joins the batch as
    another's prompt is computed, its handover's bookkeeping runs), not what a long prompt
    does to running streams. Pure."""
    decodes = [r["times"] for r in results if r["kind"] == "decode" and r["times"]]
    start = max([since, *(times[0] for times in decodes)])
    return [
        1000 * (b - a)
        for times in decodes
        for a, b in zip(times, times[1:], strict=False)
        if a >= start
    ]


def first_long_arrival_s(rows: list[WorkloadRow]) -> float:
    """When the workload's first long prompt arrives (s from its start; 0 with none). Pure."""
    return min(
        (float(r.get("arrival_s", 0.0)) for r in rows if r.get("kind") == "long"), default=0.0
    )


def same_outputs(outputs: dict[str, str], reference: dict[str, str]) -> bool:
    """Whether every request both ran answered the same (engine-pd-alone runs only the
    decodes); False when they share none. Pure."""
    shared = outputs.keys() & reference.keys()
    return bool(shared) and all(outputs[k] == reference[k] for k in shared)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def run_system(name: str, model: str | None, rows: list[WorkloadRow]) -> SystemResult:
    """One system's figures (ms) and its outputs by request id."""
    cpus = sorted(os.sched_getaffinity(0))
    since = first_long_arrival_s(rows)  # engine-pd-alone: the same window, with none arriving
    if name == "engine-pd-alone":
        rows = [row for row in rows if row.get("kind", "decode") == "decode"]
    with _system(name, model, cpus) as urls:
        url, is_pd = urls["url"], "prefill" in urls
        # engine-pd's client on the prefill worker's CPU too; the others' on every CPU.
        with thread_on_cpus({cpus[0]} if is_pd else None):
            results, wall, t0 = asyncio.run(_drive(url, rows))
        stats = httpx.get(f"{url}/router/stats").json() if is_pd else None
        workers = {
            role: httpx.get(f"{urls[role]}/kvcache/metrics", timeout=60).json()
            for role in ("prefill", "decode")
            if is_pd
        }
    gaps = decode_gaps_ms(results, t0 + since)
    ttft = [1000 * (r["times"][0] - r["sent"]) for r in results if r["kind"] == "long"]
    tokens = sum(len(r["times"]) for r in results)
    out: SystemResult = {
        "system": name,
        "itl_p50_ms": _pct(gaps, 0.5),
        "itl_p99_ms": _pct(gaps, 0.99),
        "itl_max_ms": max(gaps, default=0.0),
        "long_ttft_ms": ttft,
        "throughput_tok_s": tokens / wall,
        "wall_s": wall,
        "outputs": {r["id"]: r["text"] for r in results},
        # Seconds from the first request's send: when each stream was sent and its tokens came.
        "streams": {
            r["id"]: {
                "kind": r["kind"],
                "sent_s": r["sent"] - t0,
                "token_s": [t - t0 for t in r["times"]],
            }
            for r in results
        },  # fmt: skip
    }
    if stats is not None:
        handover = stats["handover"]
        out |= {"handover_bytes": handover["bytes"], "handover_blocks": handover["blocks"]}
        # What the handovers added after their prefills ended (the rest overlapped them): the
        # prefill worker's last blocks (publish) and the rest of the pull.
        out |= {"handover_ms": handover["after_prefill_ms"] + handover["publish_ms"]}
        out |= {"pull_ms": handover["pull_ms"], "publish_ms": handover["publish_ms"]}
        out["pd_metrics"] = workers["decode"] | {"prefill_worker": workers["prefill"]}
    return out


def run_pd_bench(
    workload: str, systems: list[str], model: str | None, limit: int | None = None
) -> list[SystemResult]:
    """Every system's figures, in order; ``same_output`` against the first system (on the
    requests both ran: engine-pd-alone runs the decodes only)."""
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; this workload runs {', '.join(SYSTEMS)}")
    lines = workload_path(workload).read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()][:limit]
    results = [run_system(name, model, rows) for name in systems]
    for result in results:
        result["same_output"] = same_outputs(result["outputs"], results[0]["outputs"])
    return results


def format_table(results: list[SystemResult]) -> str:
    head = (
        "system           ITL p50   p99     max     long TTFT (ms)    tok/s  KV handed over  same"
    )
    lines = [head]
    for r in results:
        ttft = "/".join(f"{t:.0f}" for t in r["long_ttft_ms"])
        handed = (
            f"{r['handover_bytes'] / 2**20:.1f} MiB {r['handover_ms']:.0f} ms"
            if "handover_bytes" in r
            else "-"
        )
        lines.append(
            f"{r['system']:<16} {r['itl_p50_ms']:6.1f} {r['itl_p99_ms']:7.1f}"
            f" {r['itl_max_ms']:7.1f}   {ttft:<16} {r['throughput_tok_s']:6.1f}"
            f"  {handed:<15} {r['same_output']}"
        )
    return "\n".join(lines)
