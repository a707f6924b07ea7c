"""kvcache: the pure-Python KV store core (no torch here; runner/kv_pool/store.py holds the
tensors the block ids point at).

``from kvcache import LLM, SamplingParams`` is the user-facing entry point. Those names (and
vLLM's others: ``EngineArgs``, the prompt and output types; vLLM's module paths are
``kvcache.sampling_params``, ``outputs``, ``inputs``, ``distributed`` and ``utils``) live in
``runner`` (which depends on this package, never the reverse) and are resolved on first access
(kvcache/vllm_paths.py), so importing the core alone never pulls in torch or the runner.

May import: nothing else of the project, and no torch.
"""

import sys
from typing import Any

from kvcache.block_cache import CachedBlock
from kvcache.block_manager import Allocation, BlockManager, Purpose, SlotCopy
from kvcache.hashing import block_hashes, hash_block, namespace_root
from kvcache.stats import CacheStats
from kvcache.vllm_paths import RUNNER_NAMES, runner_name

__all__ = [
    "LLM",
    "EngineArgs",
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


def __getattr__(name: str) -> Any:  # a runner name, typed where it is defined
    return runner_name(sys.modules[__name__], name, tuple(RUNNER_NAMES))
