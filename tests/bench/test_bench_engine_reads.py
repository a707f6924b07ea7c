"""What the measuring code reads of the engine through its interface
(runner/engine/api/interface.py) instead of its parts: the recorded steps, each step's
schedule, whether a request is still held, and what runs a step's forward for profilers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from kvcache import LLM, SamplingParams
from runner.attention.backend import AttentionCall
from runner.engine.api.interface import EngineInterface
from runner.engine.step.scheduler import SchedulerOutput
from runner.model.decoder import CausalLM

GREEDY = SamplingParams(max_tokens=3, temperature=0)
PROMPTS = [[5 + i for i in range(9)], [7, 8, 9, 10, 11]]


def _llm(folder: Path, **options: object) -> EngineInterface:
    return LLM(str(folder), block_size=4, num_kv_blocks=64, **options)


def test_recorded_steps_are_the_metrics_steps(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir)
    llm.generate(PROMPTS, GREEDY)
    steps, rows = llm.recorded_steps(), llm.metrics()["steps"]
    assert len(steps) == len(rows) > 1
    for step, row in zip(steps, rows, strict=True):
        assert step.t_start_s == row["t_start_s"] and step.duration_s == row["duration_s"]
        assert step.num_prefill_tokens == row["num_prefill_tokens"]
        assert step.num_decode_tokens == row["num_decode_tokens"]
    assert sum(s.num_prefill_tokens for s in steps) == sum(len(p) for p in PROMPTS)
    assert llm.recorded_steps(1) == steps[1:] and llm.recorded_steps(-1) == steps[-1:]
    assert llm.recorded_steps(len(steps)) == []
    assert _llm(tiny_llama_dir, record_metrics=False).recorded_steps() == []


def test_schedule_listeners_see_every_step_before_it_runs(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir)
    seen: list[tuple[int, int, int]] = []  # prefill, decode, steps recorded when told

    def listener(out: SchedulerOutput) -> None:
        recorded = len(llm.recorded_steps())
        seen.append((out.num_prefill_tokens, out.num_decode_tokens, recorded))

    llm.add_schedule_listener(listener)
    outs = llm.generate(PROMPTS, GREEDY)
    steps = llm.recorded_steps()
    ran = [(p, d) for p, d, _ in seen if p or d]  # an empty schedule records no step
    assert ran == [(s.num_prefill_tokens, s.num_decode_tokens) for s in steps]
    assert [r for p, d, r in seen if p or d] == list(range(len(steps)))  # told before its step
    plain = _llm(tiny_llama_dir).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # answers unchanged


def test_live_requests_are_held_until_their_last_sample_finishes(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir)
    assert not llm.has_live_requests()
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=2, n=2, temperature=1.0, seed=1))
    assert llm.has_live_requests()
    while llm.has_unfinished():
        llm.step()
    assert not llm.has_live_requests()


def test_forward_parts_and_an_instrumented_backend(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir, cpu_kernels=False)
    parts = llm.forward_parts()
    assert isinstance(parts.model, CausalLM) and parts.decode_graphs is None
    assert parts.cpu_layers is None and parts.attention.name in ("torch", "cpu")
    assert llm.eos_ids and all(isinstance(t, int) for t in llm.eos_ids)
    plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, cache_salt="plain")]
    calls: list[int] = []
    inner = parts.attention.attend

    def counted(call: AttentionCall) -> torch.Tensor:
        calls.append(1)
        return inner(call)

    llm.attend_through(replace(parts.attention, attend=counted))
    assert llm.forward_parts().attention.attend is counted
    again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, cache_salt="counted")]
    assert again == plain and calls  # every eager forward went through it, answers unchanged
