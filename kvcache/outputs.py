"""vLLM's `vllm.outputs` path: `from kvcache.outputs import ...` as vLLM's scripts import
from it (the names live in the runner, resolved on first access: kvcache/vllm_paths.py)."""

from kvcache.vllm_paths import alias_getattr

NAMES = (
    "RequestOutput",
    "CompletionOutput",
)

__getattr__ = alias_getattr(__name__, NAMES)
