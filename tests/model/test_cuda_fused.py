"""The fused elementwise kernels in the model's layers on CUDA (runner/backends/triton/
fused_elementwise.py: the residual add folded into the RMSNorm after it, SiLU(gate) * up;
runner/backends/triton/rope_store.py: RoPE with the K/V store): a GPU step with Triton attention
runs them, and float32 greedy output still equals transformers'. Skipped without CUDA (the
layer-level calls are tested in the interpreter in tests/backends/triton/
test_triton_fused_elementwise.py and test_triton_rope_store.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache import LLM, SamplingParams
from runner.attention.metadata import AttentionMetadata
from runner.backends.registry import attention_backend
from runner.backends.torch.backend import TORCH_ATTENTION
from runner.kv_pool.store import KVStore
from runner.model.loader import load_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
PROMPTS = [list(range(3, 3 + n)) for n in (1, 9, 33)] + [[7, 300, 11] * 20]


@cuda
def test_triton_step_runs_the_fused_kernels(make_tiny_model: Callable[..., Path]) -> None:
    """A float32 prefill through the Triton backend launches the fused kernels (RoPE with the
    K/V store instead of store_kv) and gives the torch path's logits (which fuses nothing)."""
    model = load_model(make_tiny_model("qwen3"), device="cuda", dtype=torch.float32).model
    kv = KVStore(
        model.num_layers, 16, 16, model.num_kv_heads, model.head_dim, torch.float32, "cuda"
    )
    meta = AttentionMetadata.build([20], [20], [[1, 2]], 16, "cuda")
    ids = torch.arange(3, 23, device="cuda")
    pos = torch.arange(20, device="cuda")
    with torch.inference_mode():
        ref = model.compute_logits(model(ids, pos, meta, kv, TORCH_ATTENTION))
        triton = attention_backend("triton")
        model(ids, pos, meta, kv, triton)  # compile outside the profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = model.compute_logits(model(ids, pos, meta, kv, triton))
            torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert any("_add_rms_norm_kernel" in n for n in names), sorted(names)
    assert any("_silu_mul_kernel" in n for n in names), sorted(names)
    assert any("_rope_store_kernel" in n for n in names), sorted(names)
    assert not any("_store_kv_kernel" in n for n in names), sorted(names)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# Phi-3 with half of each head rotated: the fused RoPE's partial rotary.
PARTIAL = {
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
}


@cuda
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("qwen3", {}), ("phi3", PARTIAL)],
    ids=["llama", "qwen3", "phi3-partial-rotary"],
)
def test_fused_layers_float32_greedy_equals_hf(
    make_tiny_model: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(arch, **overrides)
    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    refs = []
    with torch.inference_mode():
        for p in PROMPTS:
            out = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=0,
            )
            refs.append(out[0, len(p) :].tolist())
    del hf
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for eager in (True, False):  # eager steps, then decode graphs (they capture the kernels)
        llm = LLM(
            str(path), device="cuda", dtype="float32", attention_backend="triton",
            enforce_eager=eager, num_kv_blocks=512,
        )  # fmt: skip
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == refs, f"eager={eager}"
        del llm
