"""Starting an engine from the command line: the process-wide settings only the CLI may touch."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def start_up_without_gc() -> Iterator[None]:
    """Start an engine without the cyclic collector. Start-up (torch, transformers, the model)
    makes some 300k objects that live on, and the collector would walk them all several times
    while they are made: about 0.5 s on 2 cores. Instead nothing is collected until the end,
    then the start-up's garbage once. The collector is the process's, so this belongs to the
    CLI, not to the library; its state is restored as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if was_enabled:
            gc.enable()
