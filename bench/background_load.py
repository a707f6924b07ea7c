"""`kvcache bench --background-load N`: N processes that spin on the CPU while the systems run,
so that a figure for a busy machine is one command. The bench starts them and kills them on the
way out, whatever the way (an error, ctrl-c); a spinner whose bench died without that (SIGKILL)
sees its parent gone and stops by itself."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# A busy loop that checks, a few times a second, that the process that started it is still its
# parent: an orphan is adopted by another process, and then it stops.
SPIN = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


@contextmanager
def background_load(processes: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run `processes` spinning Python processes for the duration of the block; yields them.
    Each is killed and waited for on exit, so none outlives the block."""
    if processes < 0:
        raise ValueError(f"background load must be 0 or more processes, got {processes}")
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(processes):
            spinners.append(
                subprocess.Popen(
                    [sys.executable, "-c", SPIN, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def load_note(processes: int) -> str:
    """The table's line about the load the systems ran under."""
    if not processes:
        return ""
    cores = len(os.sched_getaffinity(0))
    return (
        f"\nbackground load: {processes} spinning process{'es' if processes > 1 else ''} "
        f"on {cores} core{'s' if cores > 1 else ''} while every system ran"
    )
