"""vLLM's `vllm.utils` path, for its scripts' command lines: `FlexibleArgumentParser`
(kvcache/utils/argparse_utils.py, vLLM's `vllm.utils.argparse_utils`).

May import: nothing else of the project (pure Python, no torch)."""

from kvcache.utils.argparse_utils import FlexibleArgumentParser, human_readable_int

__all__ = ["FlexibleArgumentParser", "human_readable_int"]
