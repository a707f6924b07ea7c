"""A decode worker's pulls on CPUs of their own (`kvcache serve --role decode --pull-cpus`): a
pull's thread runs there and goes back where it ran after, the output is the colocated
engine's, and a bad --pull-cpus is refused before the model loads."""

from __future__ import annotations

import os
import threading

import pytest
from click.testing import CliRunner

from cli import main
from kvcache import LLM
from runner.disagg.cpus import allowed_cpus, thread_on_cpus
from runner.disagg.roles import RoleOptions
from tests.pd.conftest import WorkerFactory
from tests.pd.test_handover import PROMPT, complete, expected, handover


def test_a_thread_runs_on_its_cpus_and_goes_back() -> None:
    before = os.sched_getaffinity(0)
    one = {min(before)}
    seen: dict[str, set[int]] = {}

    def other_thread() -> None:
        with thread_on_cpus(one):
            seen["inside"] = os.sched_getaffinity(0)
            seen["main"] = os.sched_getaffinity(threading.main_thread().native_id or 0)
        seen["after"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    # Linux's affinity is a thread's own: the main thread kept every CPU meanwhile.
    assert seen == {"inside": one, "main": before, "after": before}
    with thread_on_cpus(None):
        assert os.sched_getaffinity(0) == before


def test_bad_pull_cpus_are_refused() -> None:
    with pytest.raises(ValueError, match="--pull-cpus: CPU 4096 is not available"):
        allowed_cpus("4096", "--pull-cpus")
    with pytest.raises(ValueError, match="--pull-cpus: 'x' is not a CPU number"):
        allowed_cpus("x", "--pull-cpus")
    with pytest.raises(ValueError, match="a decode worker's option"):
        RoleOptions(role="prefill", pull_cpus=frozenset({0}))
    # The serve command says so before it loads a model.
    result = CliRunner().invoke(main, ["serve", "--role", "decode", "--pull-cpus", "4096"])
    assert result.exit_code != 0 and "--pull-cpus: CPU 4096 is not available" in result.output
    result = CliRunner().invoke(main, ["serve", "--role", "prefill", "--pull-cpus", "0"])
    assert result.exit_code != 0 and "a decode worker's option" in result.output


def test_a_pull_on_its_own_cpus_gives_the_colocated_output(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    one = frozenset({max(os.sched_getaffinity(0))})
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    with worker("prefill") as prefill, worker("decode", pull_cpus=one) as decode:
        params, pulled = handover(prefill, decode, body)
        assert pulled["cpus"] == sorted(one) and pulled["reason"] is None
        assert pulled["blocks"] == params["num_blocks"] > 0
        answer = complete(decode, body)
        assert answer["choices"][0]["text"] == expected(reference_llm, PROMPT, 16)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == pulled["blocks"] * decode.llm.config.block_size
