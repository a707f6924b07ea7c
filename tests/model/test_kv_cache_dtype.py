"""`kv_cache_dtype="float16"`: the CPU engine stores a float32 model's keys and values in half
the bytes, rounded as they are stored, and attends to them widened back to float32.

The reference is transformers' own unbatched greedy `generate` on the same float32 weights with
a cache that rounds each new key and value to float16 the same way: attention over rounded K/V
in float32 arithmetic is what the engine computes, so it must match token for token, as the
float32 engine matches the float32 model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_reference import (
    ARCH_FIXTURES,
    assert_greedy_matches,
    hf_references,
    make_prompts,
)
from transformers import AutoModelForCausalLM

from bench.weight_quality import float16_kv
from kvcache import LLM, SamplingParams
from runner.engine.executor.build import kv_cache_dtype_of
from tests.conftest import load_hf_reference

F16 = {"kv_cache_dtype": "float16"}
VARIANTS: dict[str, dict[str, Any]] = {
    "c-layers": {},
    "cache-off": {"enable_prefix_caching": False},
    "small-chunks": {"max_num_batched_tokens": 7},
    "tiny-pool": {"num_kv_blocks": 40, "block_size": 4},
    "no-cpu-kernels": {"cpu_kernels": False},  # torch's attention over the float16 cache
}


@pytest.fixture(scope="module", params=ARCH_FIXTURES)  # every layout the C layers run
def f16_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]]]:
    path: Path = request.getfixturevalue(request.param)
    hf = load_hf_reference(path)
    prompts, refs = hf_references(hf, seed=5, options=lambda: float16_kv(hf))
    return path, prompts, refs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf_with_a_rounding_cache(f16_case: Any, variant: str) -> None:
    path, prompts, refs = f16_case
    llm = LLM(str(path), **F16, **VARIANTS[variant])
    assert llm.kv.tensor.dtype == torch.float16
    assert_greedy_matches(llm, prompts, refs, alone=variant == "c-layers")


def test_the_rounding_is_what_the_reference_tests(tiny_llama_dir: Path) -> None:
    """The reference is not the float32 model's: on the same prompts some logits differ (so the
    test above would catch an engine that kept float32 K/V or rounded them otherwise)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([make_prompts(hf.config.vocab_size, seed=5)[1]])
    with torch.inference_mode():
        plain = hf(ids).logits
        rounded = hf(ids, **float16_kv(hf)).logits
    assert not torch.equal(plain, rounded)
    torch.testing.assert_close(plain, rounded, atol=1e-2, rtol=0)


@pytest.mark.parametrize("variant", ["c-layers", "no-cpu-kernels"])
def test_log_probabilities_are_those_of_attention_over_rounded_kv(
    tiny_qwen2_dir: Path, variant: str
) -> None:
    """Greedy tokens of a tiny model barely notice the rounding, so compare numbers: the
    engine's log-probabilities of a prompt (prefill) and of its answer (decode steps over the
    cache) equal transformers' with the rounding cache within float order (1e-4), ten times
    closer than to the float32 model's own."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    prompt = make_prompts(hf.config.vocab_size, seed=5)[3]
    llm = LLM(str(tiny_qwen2_dir), **F16, **VARIANTS[variant])
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    out = llm.generate([prompt], params)[0]
    ours = torch.tensor(
        [lp.logprob for lp in out.prompt_logprobs[1:]] + [lp.logprob for lp in out.logprobs]
    )
    ids = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        found = {}
        for name, options in (("rounded", float16_kv(hf)), ("float32", {})):
            logp = torch.log_softmax(hf(ids, **options).logits[0, :-1].float(), dim=-1)
            found[name] = logp.gather(1, ids[0, 1:, None])[:, 0]
    gap = (found["rounded"] - found["float32"]).abs().max().item()
    assert (ours - found["rounded"]).abs().max().item() < min(1e-4, gap / 10)


def test_the_pool_holds_twice_the_tokens(tiny_llama_dir: Path) -> None:
    budget = {"kv_cache_memory_bytes": 1 << 20}
    full, half = LLM(str(tiny_llama_dir), **budget), LLM(str(tiny_llama_dir), **budget, **F16)
    assert half.kv.num_blocks == 2 * full.kv.num_blocks
    assert half.kv.nbytes == full.kv.nbytes


def test_a_saved_cache_loads_only_into_the_same_dtype(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    saver = LLM(str(tiny_llama_dir), **F16)
    answer = saver.generate([prompt], params)[0].token_ids
    saver.save_prefix_cache(path)
    loader = LLM(str(tiny_llama_dir), **F16)
    loader.load_prefix_cache(path)
    out = loader.generate([prompt], params)[0]
    assert out.num_cached_tokens == len(prompt) - 1 and out.token_ids == answer
    with pytest.raises(ValueError, match="dtype|K/V"):
        LLM(str(tiny_llama_dir)).load_prefix_cache(path)


def test_bad_values_are_refused_by_name(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="float8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="bfloat16")


def test_on_a_gpu_the_cache_holds_the_models_dtype() -> None:
    """The Triton kernels read the model's dtype: a narrower cache there is refused up front
    (checked without a GPU: the choice is made before anything is allocated)."""
    cuda = torch.device("cuda")
    assert kv_cache_dtype_of("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert kv_cache_dtype_of("float16", torch.float16, cuda) == torch.float16
    with pytest.raises(ValueError, match="CPU only"):
        kv_cache_dtype_of("float16", torch.bfloat16, cuda)
    assert kv_cache_dtype_of("float16", torch.float32, torch.device("cpu")) == torch.float16
