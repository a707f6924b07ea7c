"""Pinning a worker to its own cores (`kvcache serve --cpus 0` or `--cpus 2-3,6`), with torch's
threads set to match, so on one machine a prefill worker cannot take a decode worker's time;
and one thread for a while (the disaggregation bench's client, beside the prefill worker)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def parse_cpus(text: str) -> set[int]:
    """The CPUs "0", "0,2" or "0-3,6" name. Raises ValueError naming the problem."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(f"--cpus: {part.strip()!r} is not a CPU number or range") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"--cpus: {part.strip()!r} is not a CPU range")
        cpus.update(range(lo, hi + 1))
    return cpus


def pin_to_cpus(text: str) -> set[int]:
    """Run this process (every thread it starts from now on) on those CPUs only, with as many
    torch threads; returns the CPUs. Raises ValueError for CPUs this machine does not let it
    use."""
    import torch

    cpus = parse_cpus(text)
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        missing = ", ".join(str(c) for c in sorted(cpus - allowed))
        raise ValueError(f"--cpus: CPU {missing} is not available (allowed: {sorted(allowed)})")
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    return cpus


@contextmanager
def thread_on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """Run the calling thread alone on ``cpus`` for the body (Linux's affinity is a thread's
    own), then where it ran before; None: where it is."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
