"""The pieces of a role on their own: a prefill worker's held handovers (bounded, released,
expired), the --cpus parser and pinning (a process, and one thread for a while), and the serve
command's checks of --role options."""

from __future__ import annotations

import os
import threading
import time

import pytest
from click.testing import CliRunner

from cli import main
from runner.disagg.cpus import parse_cpus, pin_to_cpus, thread_on_cpus
from runner.disagg.held import HeldHandovers
from runner.disagg.roles import RoleOptions


def test_held_handovers_are_bounded_released_and_expire() -> None:
    held = HeldHandovers(capacity_bytes=10, ttl_s=0.2)
    held.hold("a", [1, 2], [b"aaaa", b"bb"])
    assert held.get("a", [2, 1, 3]) == [b"bb", b"aaaa", None]
    held.hold("b", [3], [b"cccccc"])  # 12 bytes > 10: the oldest ("a") goes
    assert held.get("a", [1]) == [None] and held.get("b", [3]) == [b"cccccc"]
    assert held.release("b") and not held.release("b")
    assert held.stats() == {"held": 0, "held_bytes": 0, "expired": 1, "released": 1}
    held.hold("c", [4], [b"d"])
    time.sleep(0.3)
    assert held.get("c", [4]) == [None]  # never pulled: freed at its deadline
    assert held.stats()["expired"] == 2


def test_cpus_are_parsed_and_pinned() -> None:
    assert parse_cpus("0") == {0} and parse_cpus("0-2,5") == {0, 1, 2, 5}
    for bad in ("x", "3-1", "-1"):
        with pytest.raises(ValueError, match="--cpus"):
            parse_cpus(bad)
    before = os.sched_getaffinity(0)
    try:
        with pytest.raises(ValueError, match="not available"):
            pin_to_cpus(str(max(before) + 1))
        assert pin_to_cpus(str(min(before))) == {min(before)}
        assert os.sched_getaffinity(0) == {min(before)}
    finally:
        os.sched_setaffinity(0, before)


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


def test_role_options_are_checked() -> None:
    assert RoleOptions(role="prefill", handover="zmq://127.0.0.1:5555").zmq_address() == (
        "127.0.0.1",
        5555,
    )
    with pytest.raises(ValueError, match="role must be one of"):
        RoleOptions(role="middle")
    with pytest.raises(ValueError, match="handover must be"):
        RoleOptions(handover="tcp://x")
    result = CliRunner().invoke(main, ["serve", "--role", "prefill", "--handover", "bogus"])
    assert result.exit_code != 0 and "handover must be" in result.output
