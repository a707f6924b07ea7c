"""kvcache: the pure-Python KV store core (no torch here; ``kvcache.store`` holds the tensors).

``from kvcache import LLM, SamplingParams`` is the user-facing entry point. Those two names live
in ``runner`` (which depends on this package, never the reverse) and are resolved on first
access, so importing the core alone never pulls in torch or the runner.

May import: nothing else of the project (kvcache.store alone may import torch).
"""

import importlib
from typing import Any

from kvcache.block_cache import CachedBlock
from kvcache.block_manager import Allocation, BlockManager, Purpose, SlotCopy
from kvcache.hashing import block_hashes, hash_block, namespace_root
from kvcache.stats import CacheStats

_ENGINE_NAMES = {
    "LLM": "runner.engine.api.llm",
    "SamplingParams": "runner.sampling.params",
    "RequestOutput": "runner.engine.io.outputs",
    "StructuredOutputsParams": "runner.sampling.structured_outputs",
    "BeamSearchParams": "runner.engine.api.beam_search",
    # vLLM's names for its prompt dicts and output parts.
    "TextPrompt": "runner.engine.io.prompt_inputs",
    "TokensPrompt": "runner.engine.io.prompt_inputs",
    "CompletionOutput": "runner.engine.io.outputs",
    "Logprob": "runner.engine.io.outputs",
}

__all__ = [
    "LLM",
    "BeamSearchParams",
    "Allocation",
    "BlockManager",
    "CacheStats",
    "CachedBlock",
    "Purpose",
    "SlotCopy",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "TextPrompt",
    "TokensPrompt",
    "SamplingParams",
    "StructuredOutputsParams",
    "block_hashes",
    "hash_block",
    "namespace_root",
]


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        return getattr(importlib.import_module(_ENGINE_NAMES[name]), name)
    raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
