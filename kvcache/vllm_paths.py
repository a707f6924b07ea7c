"""The runner's names that vLLM's module paths reach (`kvcache.sampling_params`,
`kvcache.outputs`, ...: vLLM's `vllm.sampling_params`, `vllm.outputs`, ...), resolved on first
access by the alias modules' `__getattr__`, so importing the core alone never pulls in torch or
the runner (which depends on this package, never the reverse)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

# name -> the runner module that defines it.
RUNNER_NAMES = {
    "LLM": "runner.engine.api.llm",
    "EngineArgs": "runner.engine.api.engine_args",
    "SamplingParams": "runner.sampling.params",
    "RequestOutput": "runner.engine.requests.outputs",
    "CompletionOutput": "runner.engine.requests.outputs",
    "Logprob": "runner.engine.requests.outputs",
    "StructuredOutputsParams": "runner.sampling.structured_outputs",
    "BeamSearchParams": "runner.engine.api.beam_search",
    "TextPrompt": "runner.engine.requests.prompt_inputs",
    "TokensPrompt": "runner.engine.requests.prompt_inputs",
    "cleanup_dist_env_and_memory": "runner.engine.api.memory_cleanup",
}


def runner_name(module: ModuleType, name: str, offered: tuple[str, ...]) -> Any:
    """`name` of the runner, where the alias `module` offers it; AttributeError otherwise."""
    if name in offered:
        return getattr(importlib.import_module(RUNNER_NAMES[name]), name)
    raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")


def alias_getattr(module_name: str, offered: tuple[str, ...]) -> Callable[[str], Any]:
    """The `__getattr__` of the alias module `module_name`, which offers the runner's names
    `offered`: each is a runner name, typed where it is defined."""

    def __getattr__(name: str) -> Any:
        return runner_name(sys.modules[module_name], name, offered)

    return __getattr__
