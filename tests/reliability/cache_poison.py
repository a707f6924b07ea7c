"""A prefix-cache file whose answer block is relabelled with token ids outside the vocabulary:
everything else in it is as the engine saved it (shared by the tests of issue 24, item 7)."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvcache import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # two blocks of 4
BAD_ID = 10**6


def poisoned_cache(model: Path, path: Path) -> list[int]:
    """Save the cache of one greedy answer to PROMPT (block size 4), then give the block after
    the prompt, the answer's first, guessed tokens past the vocabulary; returns the answer."""
    llm = LLM(str(model), block_size=4)
    answer = llm.generate([PROMPT], GREEDY)[0].token_ids
    llm.save_prefix_cache(path)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    tokens = tensors["tokens"]
    row = next(i for i, r in enumerate(tokens.tolist()) if r[0] == answer[0])
    tokens[row, 1:] = BAD_ID  # the guesses a request with this prompt is offered next
    save_file(tensors, str(path), metadata=metadata)
    return answer
