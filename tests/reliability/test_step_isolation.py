"""One request's failure fails that request only, never the others of its step: a step whose
model or sampler raises runs again one request at a time (runner/engine/step/isolation.py), a
request whose speculative guesses raise runs again without them, and only a request that raises
alone too comes back with finish_reason "error" (issue 24, item 7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import runner.engine.kv.prefix_cache_file
from kvcache import LLM
from runner.engine.step.scheduler import ScheduledSeq
from tests.reliability.cache_poison import GREEDY, PROMPT, poisoned_cache

OTHERS = [[20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36]]


def references(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy answer on an engine with no guesses and no failures."""
    llm = LLM(str(model), block_size=4)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_a_guess_that_raises_fails_no_one(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache that lies past the load's checks (its check switched off here) offers guesses
    outside the vocabulary: the model's embedding raises IndexError for the step. The guessing
    request runs again without its guesses; every request of the step gets its answer."""
    path = tmp_path / "poisoned.safetensors"
    poisoned_cache(tiny_llama_dir, path)
    monkeypatch.setattr(
        runner.engine.kv.prefix_cache_file, "check_token_ids", lambda *args: None, raising=False
    )
    llm = LLM(str(tiny_llama_dir), block_size=4, speculative_tokens=4)
    assert llm.load_prefix_cache(path) > 0
    run, raised = llm.runner.run, []

    def watched(batch: list[ScheduledSeq]) -> Any:
        try:
            return run(batch)
        except IndexError:
            raised.append(len(batch))
            raise

    monkeypatch.setattr(llm.runner, "run", watched)
    prompts = [PROMPT, *OTHERS]
    outs = llm.generate(prompts, GREEDY)
    assert [o.finish_reason for o in outs] == ["length"] * 3, [o.error for o in outs]
    assert [o.token_ids for o in outs] == references(tiny_llama_dir, prompts)
    assert raised[:2] == [3, 1], raised  # the whole step raised, then the guesser alone
    llm.block_manager.check_integrity()
    assert llm.block_manager.stats.blocks_in_use == 0


def test_a_request_that_raises_alone_fails_alone(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that raises whenever one request is in its batch: that request fails, the two
    sharing its steps get the answers they get without it."""
    llm = LLM(str(tiny_llama_dir), block_size=4)
    run = llm.runner.run
    poisoned = PROMPT

    def run_unless_poisoned(batch: list[ScheduledSeq]) -> Any:
        if any(item.seq.prompt_token_ids == poisoned for item in batch):
            raise RuntimeError("this request breaks the model")
        return run(batch)

    monkeypatch.setattr(llm.runner, "run", run_unless_poisoned)
    prompts = [OTHERS[0], PROMPT, OTHERS[1]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error == "RuntimeError: this request breaks the model"
    assert outs[0].token_ids == references(tiny_llama_dir, [OTHERS[0]])[0]
    assert outs[2].token_ids == references(tiny_llama_dir, [OTHERS[1]])[0]
    rows = {r["id"]: r["finish_reason"] for r in llm.metrics()["requests"]}
    assert sorted(rows.values()) == ["error", "length", "length"]
    llm.block_manager.check_integrity()
    assert llm.block_manager.stats.blocks_in_use == 0
