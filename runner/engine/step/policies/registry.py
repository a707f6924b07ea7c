"""The scheduling policies by name (EngineConfig.batching): the scheduler picks one here once,
when it is built; nothing else dispatches on the name. A new rule is one file beside these and
one entry below."""

from __future__ import annotations

from collections.abc import Callable

from runner.engine.step.policies.continuous import ContinuousBatching
from runner.engine.step.policies.policy import SchedulingPolicy
from runner.engine.step.policies.priority import PriorityScheduling
from runner.engine.step.policies.static import StaticBatching

POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "continuous": ContinuousBatching,
    "static": StaticBatching,
    "priority": PriorityScheduling,
}


def policy_for(name: str) -> SchedulingPolicy:
    """The policy called `name`; ValueError names the known ones."""
    if name not in POLICIES:
        known = ", ".join(repr(n) for n in POLICIES)
        raise ValueError(f"batching must be one of {known}, got {name!r}")
    return POLICIES[name]()
