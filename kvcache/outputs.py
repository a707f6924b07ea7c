"""vLLM's `vllm.outputs` path: `from kvcache.outputs import ...` as vLLM's scripts import
from it (the names live in the runner, resolved on first access: kvcache/vllm_paths.py)."""

import sys
from typing import Any

from kvcache.vllm_paths import runner_name

NAMES = (
    "RequestOutput",
    "CompletionOutput",
)


def __getattr__(name: str) -> Any:  # a runner name, typed where it is defined
    return runner_name(sys.modules[__name__], name, NAMES)
