"""Greedy output of the engine equals transformers' unbatched greedy `generate`, token for token
(up to and including the stop token), with the cache on and off, alone and batched, with small
chunks and under preemption."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_reference import ARCH_FIXTURES, hf_greedy, make_prompts

from kvcache import LLM, SamplingParams
from tests.conftest import load_hf_reference

ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "cache-on": {},
    "cache-off": {"enable_prefix_caching": False},
    "small-chunks": {"max_num_batched_tokens": 7},
    "tiny-pool": {"num_kv_blocks": 40, "block_size": 4},
    "static": {"batching": "static"},
    "unpacked-weights": {"prepack_weights": False},
    "no-cpu-kernels": {"cpu_kernels": False},  # oneDNN products, torch attention throughout
}


@pytest.fixture(scope="module", params=ARCH_FIXTURES)
def arch_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]], int]:
    """(model dir, prompts, reference outputs, stop token) for one architecture."""
    path: Path = request.getfixturevalue(request.param)
    hf = load_hf_reference(path)
    vocab = hf.config.vocab_size
    prompts = make_prompts(vocab, seed=len(request.param))
    # Pick as stop token one that the model emits a few tokens into the first answer, so some
    # answers end with it ("stop") and others run to max_tokens ("length").
    free_run = hf_greedy(hf, prompts[0], 12, None)
    stop = free_run[4]
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 12, stop) for p in prompts]
    return path, prompts, refs, stop


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_batched_greedy_matches_hf(arch_case: Any, variant: str) -> None:
    path, prompts, refs, stop = arch_case
    llm = LLM(str(path), **ENGINE_VARIANTS[variant])
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])
    outs = llm.generate(prompts, params)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.token_ids == ref, f"prompt {i} differs from transformers"
        assert out.finish_reason == ("stop" if ref[-1] == stop else "length")
    # The second pass runs fully warm: same outputs, and the cache (when on) is used.
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == refs
    if llm.config.enable_prefix_caching:
        assert sum(o.num_cached_tokens for o in again) > 0
    else:
        assert sum(o.num_cached_tokens for o in again) == 0
    llm.block_manager.check_integrity()
    if variant == "tiny-pool":
        assert llm.scheduler.num_preemptions > 0


def test_alone_matches_hf(arch_case: Any) -> None:
    path, prompts, refs, stop = arch_case
    llm = LLM(str(path))
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])
    for prompt, ref in zip(prompts, refs, strict=True):
        assert llm.generate([prompt], params)[0].token_ids == ref


def test_cached_prefix_logits_match_cold(tiny_llama_dir: Path) -> None:
    """Logits of a prompt whose prefix comes from the cache (two full blocks shared, then the
    first request's 8-token tail copied into a block of its own) equal a cold prefill's."""
    rng = random.Random(3)
    prefix = [rng.randrange(3, 200) for _ in range(40)]
    prompt = prefix + [rng.randrange(3, 200) for _ in range(9)]
    warm = LLM(str(tiny_llama_dir))
    warm.generate([prefix], SamplingParams(max_tokens=1, temperature=0))
    cold = LLM(str(tiny_llama_dir), enable_prefix_caching=False)
    rows = []
    for llm in (warm, cold):
        llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
        out = llm.scheduler.schedule()
        rows.append(llm.runner.run(out.scheduled)[0])
        assert out.scheduled[0].start == (40 if llm is warm else 0)
    torch.testing.assert_close(rows[0], rows[1], atol=1e-4, rtol=1e-4)


def test_num_cached_tokens_is_exact(tiny_llama_dir: Path) -> None:
    rng = random.Random(5)
    first = [rng.randrange(3, 200) for _ in range(100)]
    llm = LLM(str(tiny_llama_dir), block_size=16)
    params = SamplingParams(max_tokens=2, temperature=0)
    assert llm.generate([first], params)[0].num_cached_tokens == 0
    more = first + [rng.randrange(3, 200) for _ in range(20)]
    # 6 full blocks, and the 4 tokens of the first request's tail (its 7th block, partial).
    assert llm.generate([more], params)[0].num_cached_tokens == 100
    # A prompt that is entirely cached still computes its last token: block 0 is shared, and
    # 15 slots of the cached block 1 are copied.
    assert llm.generate([first[:32]], params)[0].num_cached_tokens == 31


def test_shared_prefix_decode_matches_hf(arch_case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose prompts all share a long prefix decodes through the cascade path (the
    torch attention path's; the CPU backend's decode kernel would take these steps) in its
    full-attention layers, and still equals transformers token for token."""
    import runner.backends.torch.paged as attention

    path, prompts, _, _ = arch_case
    shared = [p for p in prompts if p[:64] == prompts[0][:64] and len(p) > 64]
    hf = load_hf_reference(path)
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 12, None) for p in shared]
    calls = []
    original = attention.cascade_attention
    monkeypatch.setattr(
        attention, "cascade_attention", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    llm = LLM(str(path), attention_backend="torch")
    outs = llm.generate(shared, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    # A sliding window may cut into the prefix, and capped scores (Gemma 2) are scored apart
    # (runner/backends/torch/capped.py): only plain full-attention layers read it once.
    attns = [layer.self_attn for layer in llm.model.layers]
    if any(a.sliding_window is None and a.softcap is None for a in attns):
        assert calls, "the shared-prefix decode path was not taken"
