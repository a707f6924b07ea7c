"""A submission's on_queued hook runs on the engine's thread once its request is queued and
before any step computes it; a hook that raises is logged and the request still answers."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from runner.engine.sequence import Sequence
from runner.serve.engine_loop import EngineLoop
from runner.serve.events import Accepted, Done, Event, Submission
from runner.serve.metrics import ServeMetrics

PROMPT = "The hook runs before the first step of this prompt, which takes several chunks. " * 3


def _answer(loop: EngineLoop, sub: Submission) -> list[Event]:
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    loop.submit([sub], events.put)
    got = [events.get(timeout=60)]
    while not isinstance(got[-1], Done):
        got.append(events.get(timeout=60))
    return got


@pytest.mark.parametrize("hook_raises", [False, True])
def test_the_hook_runs_before_the_first_step(
    tiny_llama_tok_dir: Path, hook_raises: bool, caplog: pytest.LogCaptureFixture
) -> None:
    llm = LLM(str(tiny_llama_tok_dir), max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=4, temperature=0)
    (want,) = llm.generate([PROMPT], params)
    seen: list[tuple[int, int]] = []

    def hook(seqs: list[Sequence]) -> None:
        seen.append((len(seqs), seqs[0].num_computed_tokens))
        if hook_raises:
            raise RuntimeError("the hook failed")

    loop = EngineLoop(llm, ServeMetrics())
    loop.start()
    try:
        sub = Submission("r-0", 0, params, prompt=PROMPT, on_queued=hook)
        events = _answer(loop, sub)
    finally:
        loop.stop()
    assert seen == [(1, 0)]  # once, with its one sequence, none of it computed yet
    assert isinstance(events[0], Accepted)
    done = events[-1]
    assert isinstance(done, Done) and done.output.outputs[0].text == want.text
    assert ("on_queued hook failed" in caplog.text) == hook_raises
