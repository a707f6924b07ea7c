"""The reference every equivalence test compares with: transformers' unbatched greedy
`generate`, the tiny architectures it runs on (tests/conftest.py builds them), and prompts that
share prefixes so the cache hits."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from kvcache import LLM, SamplingParams

ARCH_FIXTURES = [
    "tiny_llama_dir",
    "tiny_qwen2_dir",
    "tiny_qwen3_dir",
    "tiny_phi3_dir",
    "tiny_granite_dir",
    "tiny_smollm3_dir",
    "tiny_olmo2_dir",
    "tiny_gemma2_dir",
    "tiny_gemma3_dir",
    "tiny_mistral_window_dir",  # sliding windows shorter than most prompts
    "tiny_qwen2_window_dir",
]


def make_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts that share prefixes of several lengths (so the cache hits), plus loners."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 16, 23)]
    prompts.append(system[:64])  # exactly four blocks of the shared prefix
    prompts.append(prompts[2] + [rng.randrange(3, vocab) for _ in range(9)])  # extends another
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 31)]
    return prompts


def hf_greedy(
    model: Any, prompt: list[int], max_new: int, stop: int | None, **options: Any
) -> list[int]:
    """transformers' unbatched greedy `generate`; `options` are more of its arguments."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=stop if stop is not None else -1,
        pad_token_id=0,
        **options,
    )
    return out[0, len(prompt) :].tolist()


def hf_references(
    hf: Any, seed: int, options: Callable[[], dict[str, Any]] = dict
) -> tuple[list[list[int]], list[list[int]]]:
    """make_prompts over the model's vocabulary, and transformers' greedy answers of 10 tokens
    to them (hf_greedy, never stopping early); `options()`: more of generate's arguments,
    made afresh for each prompt (a cache object must not be shared)."""
    prompts = make_prompts(hf.config.vocab_size, seed=seed)
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 10, None, **options()) for p in prompts]
    return prompts, refs


def assert_greedy_matches(
    llm: LLM, prompts: list[list[int]], refs: list[list[int]], alone: bool = False
) -> None:
    """10 greedy tokens of each prompt (EOS ignored) equal `refs`, batched cold, batched warm
    (the cache hits), and with `alone` the first three one at a time."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs  # warm: cache hits
    if alone:
        assert [llm.generate([p], params)[0].token_ids for p in prompts[:3]] == refs[:3]
