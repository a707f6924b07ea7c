"""A new attention backend is one builder and one registration: a dense backend written here
against the contract alone (runner/attention/backend.py's AttentionCall), registered in a
registry of this test's own, runs a tiny model greedy-equal to the torch path, and the default
registry stays as it was. The engine's config takes exactly the registry's names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.attention.backend import AttentionBackend, AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.registry import BACKEND_NAMES, BACKENDS, Registry, attention_backend
from runner.engine.config import EngineConfig
from runner.kv_pool.store import KVStore
from runner.model.decoder import CausalLM
from runner.model.loader import load_model

BLOCK = 4


def dense_attention(call: AttentionCall) -> torch.Tensor:
    """The contract computed plainly: store the new K/V at their slots, then per sequence read
    its keys back through its block table and take a float64 softmax over those its query
    sees (causal, within the window), with the soft cap where one is given."""
    meta, k_cache, v_cache = call.meta, call.k_cache, call.v_cache
    hkv, d = k_cache.shape[2:]
    slots = meta.slot_mapping.long()
    k_cache.view(-1, hkv, d)[slots] = call.k.to(k_cache.dtype)
    v_cache.view(-1, hkv, d)[slots] = call.v.to(v_cache.dtype)
    out = torch.empty_like(call.q)
    group = call.q.shape[1] // hkv
    row = 0
    for s, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host, strict=True)):
        table = meta.block_tables[s].long()
        key_slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:ctx]
        keys = k_cache.view(-1, hkv, d)[key_slots].double().repeat_interleave(group, dim=1)
        values = v_cache.view(-1, hkv, d)[key_slots].double().repeat_interleave(group, dim=1)
        q = call.q[row : row + q_len].double()  # [L, Hq, D]
        scores = torch.einsum("lhd,khd->hlk", q, keys) * call.scale
        if call.softcap is not None:
            scores = call.softcap * torch.tanh(scores / call.softcap)
        pos = torch.arange(ctx - q_len, ctx)[:, None]
        seen = torch.arange(ctx)[None, :] <= pos
        if call.window is not None:
            seen &= torch.arange(ctx)[None, :] > pos - call.window
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[row : row + q_len] = torch.einsum("hlk,khd->lhd", probs, values).to(out.dtype)
        row += q_len
    return out


def dense_backend(calls: list[int]) -> Registry:
    """The default backends and "dense" (counting its calls into `calls`): the one
    registration a new backend needs."""

    def build(deterministic: bool) -> AttentionBackend:
        if deterministic:
            raise ValueError("the dense backend has no batch-invariant form")

        def attend(call: AttentionCall) -> torch.Tensor:
            calls.append(call.q.shape[0])
            return dense_attention(call)

        return AttentionBackend("dense", attend)  # no capability: nothing fused or captured

    return BACKENDS.with_backend("dense", build)


def greedy(model: CausalLM, backend: AttentionBackend, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt`: a prefill of the prompt, then one decode a token."""
    shape = (model.num_layers, 16, BLOCK, model.num_kv_heads, model.head_dim)
    kv = KVStore(*shape, torch.float32, "cpu")
    table = list(range(1, 16))
    tokens, new = list(prompt), list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ctx = len(tokens)
            meta = AttentionMetadata.build([len(new)], [ctx], [table[: -(-ctx // BLOCK)]], BLOCK)
            ids, positions = torch.tensor(new), torch.arange(ctx - len(new), ctx)
            hidden = model(ids, positions, meta, kv, backend)
            new = [int(model.compute_logits(hidden[-1:]).argmax())]
            tokens += new
    return tokens[len(prompt) :]


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_gemma2_dir", "tiny_qwen2_window_dir"])
def test_a_backend_of_its_own_registry_runs_a_model_greedy_equal_to_torch(
    arch_dir: str, request: pytest.FixtureRequest
) -> None:
    """Sliding windows (Gemma 2's 16, Qwen2's 12, over 29 tokens) and capped scores (Gemma 2)
    reach the new backend through the call."""
    path: Path = request.getfixturevalue(arch_dir)
    model = load_model(str(path)).model
    calls: list[int] = []
    registry = dense_backend(calls)
    prompt = [(7 * i + 3) % 97 + 2 for i in range(21)]
    want = greedy(model, attention_backend("torch"), prompt, 8)
    got = greedy(model, registry.build("dense"), prompt, 8)
    assert got == want
    # Every layer of every step went through it: the prefill's rows, then one row a decode.
    assert calls == [len(prompt)] * model.num_layers + [1] * model.num_layers * 7
    assert "dense" in registry.names and "dense" not in BACKENDS.names  # nothing leaked
    with pytest.raises(ValueError, match="no batch-invariant form"):
        registry.build("dense", deterministic=True)


def test_a_taken_or_unknown_name_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'torch' is registered already"):
        BACKENDS.with_backend("torch", lambda deterministic: attention_backend("torch"))
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*'torch', 'cpu'"):
        attention_backend("flash")
    with pytest.raises(ValueError, match="no batch-invariant form"):
        attention_backend("torch", deterministic=True)


def test_the_engine_config_takes_the_registry_names_and_no_other() -> None:
    assert BACKEND_NAMES == ("torch", "cpu", "triton")
    for name in BACKEND_NAMES:
        assert EngineConfig(attention_backend=name).attention_backend == name
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('torch'"):
        EngineConfig(attention_backend="dense")


def test_what_the_backends_declare() -> None:
    """The engine's setup and the decoder ask these, never a name: the C layer stack for the
    C kernels' attention alone, and CUDA graphs and the fused RoPE + store for Triton's."""
    torch_caps = attention_backend("torch").capabilities
    cpu_caps = attention_backend("cpu").capabilities
    assert cpu_caps.cpu_layer_stack and not torch_caps.cpu_layer_stack
    assert not (torch_caps.supports_cuda_graphs or cpu_caps.supports_cuda_graphs)
    assert not (torch_caps.fuses_rope_store or cpu_caps.fuses_rope_store)
    pytest.importorskip("triton")
    triton_caps = attention_backend("triton").capabilities
    assert triton_caps.supports_cuda_graphs and triton_caps.fuses_rope_store
    assert triton_caps.shared_prefix_plan and not triton_caps.deterministic
    exact = attention_backend("triton", deterministic=True).capabilities
    assert exact.deterministic and exact.triton_products
    assert not (exact.supports_cuda_graphs or exact.fuses_rope_store)
