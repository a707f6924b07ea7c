"""What the overlapped loop (runner/engine/step/overlap.py) records of its steps, on the fake
device of tests/engine/test_async_scheduling.py (each step's work on a worker thread, held a
set latency longer): the steps' durations tile the wall clock instead of each spanning two
step periods, and a position dropped after a stop found one step late is counted nowhere."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvcache import RequestOutput, SamplingParams
from tests.engine.test_async_scheduling import engine, prompts


def test_recorded_step_times_tile_the_wall_clock(tiny_llama_dir: Path) -> None:
    """Each step's time runs from the later of its launch and the previous step's settling to
    its own settling: no two recorded steps overlap, and together they make up the wall time
    (timed from each launch, they added up to about twice it)."""
    llm = engine(tiny_llama_dir, True)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts(6, seed=11), params)
    wall = time.perf_counter() - start
    steps = [s for s in llm.recorder.steps if s["t_start_s"] >= start - llm.recorder.t0]
    assert len(steps) >= 16
    for before, after in zip(steps, steps[1:], strict=False):
        assert after["t_start_s"] >= before["t_start_s"] + before["duration_s"] - 1e-9
    recorded = sum(s["duration_s"] for s in steps)
    assert 0.6 * wall <= recorded <= wall


def _record(steps: list[dict[str, Any]]) -> tuple[int, int]:
    """(prefill, decode) positions the recorded steps computed."""
    prefill = sum(int(s["num_prefill_tokens"]) for s in steps)
    decode = sum(int(s["num_decode_tokens"]) for s in steps)
    return prefill, decode


def test_a_late_stops_dropped_position_is_not_counted(tiny_llama_dir: Path) -> None:
    """A request stopped by a token is found one step late; the position the next step
    computed for it is dropped, and neither its decode tokens, nor the scheduler's iteration
    tokens, nor a step's states show it: the same counts as the plain loop's."""
    batch = prompts(5, seed=12)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    free = engine(tiny_llama_dir, False).generate(batch, greedy)
    stops = [o.token_ids[2] for o in free]  # each stops a few tokens in
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[t]) for t in stops]
    plain = engine(tiny_llama_dir, False)
    expected = plain.generate(batch, params)
    assert all(o.finish_reason == "stop" for o in expected)
    llm = engine(tiny_llama_dir, True)
    for i, prompt in enumerate(batch):
        llm.add_request(prompt, params[i], request_id=str(i))
    outputs: dict[str, RequestOutput] = {}
    iteration_tokens = 0
    while llm.has_unfinished():
        for out in llm.step():
            outputs[out.request_id] = out
        iteration_tokens += llm.queue_depth().last_step_tokens
    assert [outputs[str(i)].token_ids for i in range(5)] == [o.token_ids for o in expected]
    got = _record(llm.recorder.steps)
    assert got == _record(plain.recorder.steps)
    assert iteration_tokens == sum(got)
    # Each request shows in as many steps as in the plain loop: none after it finished.
    assert _appearances(llm.recorder.steps) == _appearances(plain.recorder.steps)


def _appearances(steps: list[dict[str, Any]]) -> dict[str, int]:
    """How many steps show each request (by its index in the report)."""
    count: dict[str, int] = {}
    for step in steps:
        for index in step["states"]:
            count[index] = count.get(index, 0) + 1
    return count
