"""frozen_heap: old objects out of the collector's passes for a batch call, and back after."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcache import LLM, SamplingParams
from runner.engine.api.frozen_heap import frozen_heap


class Node:
    def __init__(self) -> None:
        self.other: Any = self


@pytest.fixture(autouse=True)
def unfrozen() -> None:
    assert gc.get_freeze_count() == 0, "the test process starts with nothing frozen"


def test_old_cycles_wait_new_cycles_are_collected() -> None:
    old = Node()
    old_ref = weakref.ref(old)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del old
        new = Node()
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None, "a cycle made during the batch is garbage as usual"
        assert old_ref() is not None, "a cycle from before is out of the collector's reach"
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None, "after the batch the old cycle is collected again"


def test_nested_and_callers_freezes_are_left_alone() -> None:
    # Frozen objects that die leave the permanent generation, so the count may fall a little
    # while other threads run; only a freeze raises it, and an unfreeze empties it.
    with frozen_heap():
        frozen = gc.get_freeze_count()
        with frozen_heap():
            assert 0 < gc.get_freeze_count() <= frozen, "the inner call must not freeze again"
        assert 0 < gc.get_freeze_count() <= frozen, "the inner call must not unfreeze the outer's"
    gc.freeze()  # the caller's own
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_unfrozen_after_an_error() -> None:
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_engine_batch_calls_run_frozen(tiny_llama_dir: Path) -> None:
    """generate, stream and run_until_done step with the heap frozen, and leave it unfrozen."""
    llm = LLM(str(tiny_llama_dir))
    seen: list[int] = []
    run: Callable[..., Any] = llm.runner.run

    def watched(*args: Any) -> Any:
        seen.append(gc.get_freeze_count())
        return run(*args)

    llm.runner.run = watched  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=3, temperature=0)
    llm.generate([[1, 2, 3]], params)
    list(llm.stream([[4, 5, 6]], params))
    llm.add_request([7, 8, 9], params)
    llm.run_until_done()
    assert len(seen) >= 9 and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0


def test_a_stream_left_early_unfreezes(tiny_llama_dir: Path) -> None:
    """A stream holds the freeze while the caller iterates; closing it early (a `break`)
    hands the old objects back to the collector."""
    llm = LLM(str(tiny_llama_dir))
    stream = llm.stream([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=8, temperature=0))
    next(stream)
    assert gc.get_freeze_count() > 0
    stream.close()
    assert gc.get_freeze_count() == 0
