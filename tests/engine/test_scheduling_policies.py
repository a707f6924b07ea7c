"""Scheduling policies (runner/engine/step/policies/): each rule is one class behind
SchedulingPolicy, chosen by name once; a new rule is one class and one registration, and the
engine runs it with the same greedy answers."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from runner.engine.config import EngineConfig
from runner.engine.sequence import SeqStatus, Sequence
from runner.engine.step.policies.continuous import ContinuousBatching
from runner.engine.step.policies.policy import SchedulerMachinery
from runner.engine.step.policies.priority import PriorityScheduling
from runner.engine.step.policies.registry import POLICIES, policy_for
from runner.engine.step.policies.static import StaticBatching
from runner.engine.step.scheduler import SchedulerOutput

# Prompts of distinct lengths that share no block, longest first.
PROMPTS = [list(range(40, 52)), list(range(60, 64)), list(range(70, 78))]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class ShortestPromptFirst:
    """A rule written against the interface alone: running decodes, then running prefills,
    then the waiting request with the shortest prompt first (first come first served among
    equals), under the token budget."""

    def schedule(self, machinery: SchedulerMachinery, out: SchedulerOutput) -> None:
        m = machinery
        budget = m.config.token_budget
        for seq in [s for s in m.running if not s.in_prefill]:
            if budget > 0 and seq.status is SeqStatus.RUNNING and m.schedule_decode(seq, out):
                budget -= 1
        for seq in [s for s in m.running if s.in_prefill]:
            if budget > 0 and seq.status is SeqStatus.RUNNING:
                budget -= m.schedule_prefill_chunk(seq, budget, out)
        while budget > 0 and m.waiting and len(m.running) < m.config.max_num_seqs:
            chosen = min(m.waiting, key=lambda s: s.num_prompt_tokens)
            if not m.bm.can_allocate(chosen.token_ids, chosen.root):
                break
            m.waiting.remove(chosen)
            m.admit(chosen, out)
            budget -= m.schedule_prefill_chunk(chosen, budget, out)

    def victim(self, running: Seq[Sequence]) -> Sequence:
        return running[-1]

    def holds_finished(self, reason: str) -> bool:
        return False


def _run(
    llm: LLM, params: SamplingParams | list[SamplingParams]
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(answers, each step's admitted prompt lengths, each step's held count)."""
    admitted: list[list[int]] = []
    held: list[int] = []

    def listener(out: SchedulerOutput) -> None:
        admitted.append([s.num_prompt_tokens for s in out.admitted])
        held.append(len(llm.scheduler.held))

    llm.add_schedule_listener(listener)
    outs = llm.generate(PROMPTS, params)
    llm.block_manager.check_integrity()
    return [o.token_ids for o in outs], admitted, held


def test_a_new_rule_is_one_class_and_one_registration(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(POLICIES, "shortest-prompt-first", ShortestPromptFirst)
    default, default_order, _ = _run(LLM(str(tiny_llama_dir), max_num_seqs=2), GREEDY)
    llm = LLM(str(tiny_llama_dir), max_num_seqs=2, batching="shortest-prompt-first")
    answers, order, held = _run(llm, GREEDY)
    assert isinstance(llm.scheduler.policy, ShortestPromptFirst)
    assert [n for step in order for n in step] == [4, 8, 12]  # the new rule's order
    assert [n for step in default_order for n in step] == [12, 4, 8]  # oldest first
    assert answers == default  # greedy answers do not depend on the order
    assert set(held) == {0}


def test_static_batching_admits_the_next_batch_once_the_last_is_done(
    tiny_llama_dir: Path,
) -> None:
    """With room for two sequences, the third prompt waits: under continuous batching only
    until the first answer (2 tokens) ends, under static batching until the second (8 tokens)
    does, the first holding its slot meanwhile. The answers are the same."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 8, 3)]
    runs = {}
    for name, policy in (("continuous", ContinuousBatching), ("static", StaticBatching)):
        llm = LLM(str(tiny_llama_dir), max_num_seqs=2, batching=name)
        assert type(llm.scheduler.policy) is policy
        runs[name] = _run(llm, params)
    (cont, cont_order, cont_held), (stat, stat_order, stat_held) = runs.values()
    assert cont == stat and [len(a) for a in cont] == [2, 8, 3]
    third_cont = next(i for i, step in enumerate(cont_order) if 8 in step)
    third_stat = next(i for i, step in enumerate(stat_order) if 8 in step)
    assert cont_order[0] == stat_order[0] == [12, 4]
    assert third_cont <= 3  # prefill, one decode: the first answer ends, its slot is free
    assert third_stat >= 8  # the second answer's 8 tokens first
    assert set(cont_held) == {0} and max(stat_held) == 1  # the first answer held its slot


def test_policies_are_chosen_by_name_and_an_unknown_name_is_refused(tiny_llama_dir: Path) -> None:
    assert isinstance(policy_for("continuous"), ContinuousBatching)
    assert isinstance(policy_for("static"), StaticBatching)
    assert isinstance(policy_for("priority"), PriorityScheduling)
    with pytest.raises(ValueError, match="batching must be one of 'continuous', 'static', .*'x'"):
        policy_for("x")
    with pytest.raises(ValueError, match="batching must be one of .* got 'fifo'"):
        LLM(str(tiny_llama_dir), batching="fifo")
    with pytest.raises(ValueError, match="batching must name a scheduling policy"):
        EngineConfig(batching="")


@pytest.mark.parametrize("reason", ["stop", "length", "abort", "error"])
def test_only_static_batching_holds_a_finished_member(reason: str) -> None:
    assert StaticBatching().holds_finished(reason) is (reason in ("stop", "length"))
    assert ContinuousBatching().holds_finished(reason) is False


def test_priority_scheduling_admits_the_lowest_priority_value_first(tiny_llama_dir: Path) -> None:
    """One sequence at a time: continuous batching admits the prompts as they came, priority
    scheduling by their priorities (2, 0, 1 here), lower first. The answers are the same."""
    default, default_order, _ = _run(LLM(str(tiny_llama_dir), max_num_seqs=1), GREEDY)
    llm = LLM(str(tiny_llama_dir), max_num_seqs=1, batching="priority")
    admitted: list[int] = []
    llm.add_schedule_listener(
        lambda out: admitted.extend(s.num_prompt_tokens for s in out.admitted)
    )
    outs = llm.generate(PROMPTS, GREEDY, priority=[2, 0, 1])
    llm.block_manager.check_integrity()
    assert [n for step in default_order for n in step] == [12, 4, 8]
    assert admitted == [4, 8, 12]
    assert [o.token_ids for o in outs] == default


@pytest.mark.parametrize(
    ("batching", "preempted"), [("continuous", "urgent"), ("priority", "late")]
)
def test_a_short_pool_preempts_the_highest_priority_value(
    tiny_llama_dir: Path, batching: str, preempted: str
) -> None:
    """A request of priority 5 runs; one of priority 0 joins it; their answers outgrow a pool
    of 8 blocks of 4 tokens. Continuous batching preempts the newest, the urgent one; priority
    scheduling the one of the higher value, though it came first (vLLM's rule). Both answers
    are the plain engine's either way."""
    params = SamplingParams(max_tokens=18, temperature=0, ignore_eos=True)
    prompts = {"late": list(range(40, 48)), "urgent": list(range(60, 68))}
    plain = LLM(str(tiny_llama_dir))
    expected = {name: out.token_ids for name, out in zip(prompts, plain.generate(
        list(prompts.values()), params), strict=True)}  # fmt: skip
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=8, block_size=4, batching=batching)
    seqs = {"late": llm.add_request(prompts["late"], params, request_id="late", priority=5)}
    llm.step()  # the first runs alone, then the urgent one arrives
    seqs["urgent"] = llm.add_request(prompts["urgent"], params, request_id="urgent", priority=0)
    answers: dict[str, list[int]] = {}
    while llm.has_unfinished():
        answers.update((out.request_id, out.token_ids) for out in llm.step())
    llm.block_manager.check_integrity()
    assert {name: seq.num_preemptions > 0 for name, seq in seqs.items()} == {
        name: name == preempted for name in seqs
    }
    assert answers == expected
