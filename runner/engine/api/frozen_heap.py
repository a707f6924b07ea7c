"""The heap that existed when a batch started, kept out of the garbage collector's passes.

Python's cyclic collector now and then walks every tracked object: with the default model
loaded that is ~300,000 objects (torch, transformers, the tokenizer), 150-200 ms in one pause,
and an engine step allocates enough to set one off every few hundred steps. On a GPU a step is
a few milliseconds, so one pause costs dozens of steps (measured on the CPU: a 209 ms host
pause in 300 decode steps of 256 sequences, 0.8 ms a step on average; scripts/host_step.py).
vLLM and SGLang freeze the heap once in their engine process. This engine runs in the caller's
process, so the freeze lasts one batch call: objects made during it are collected as usual,
cycles included, and those from before are handed back to the collector when it ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects that exist now (`gc.freeze`) for the body, then unfreeze them. A
    no-op when something is frozen already: an enclosing batch call, or the caller's own
    freeze, which is left as the caller made it."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_server_heap() -> None:
    """For a process that serves until it ends (`kvcache serve`, the bench's workers), called
    once its engine is built: collect the start-up's garbage, then freeze what is left, for
    good. Its steps run on the server's engine loop, outside any batch call, so without this a
    full pass walks the start-up's heap in the middle of the decodes: measured on a decode
    worker, 205 ms (487 ms on a loaded machine), the largest gap its streams would see."""
    gc.collect()
    gc.freeze()
