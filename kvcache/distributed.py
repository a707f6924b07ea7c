"""vLLM's `vllm.distributed` path: `from kvcache.distributed import ...` as vLLM's scripts import
from it (the names live in the runner, resolved on first access: kvcache/vllm_paths.py)."""

from kvcache.vllm_paths import alias_getattr

NAMES = ("cleanup_dist_env_and_memory",)

__getattr__ = alias_getattr(__name__, NAMES)
