"""The CUDA runner: decode graphs, GPU memory sizing, engine greedy on CUDA (the GPU bench:
test_gpu_bench.py).

Tests marked `cuda` skip cleanly without a GPU. The rest run on the CPU: the decode-graph logic
(padding rows, the fixed max_model_len decode grid) runs eagerly there through the Triton
interpreter.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache import LLM, SamplingParams, StructuredOutputsParams
from runner.attention.metadata import AttentionMetadata
from runner.backends.registry import attention_backend
from runner.backends.triton.common import interpreting
from runner.engine.config import EngineConfig
from runner.engine.kv.memory import kv_pool_blocks
from runner.kv_pool.store import KVStore
from runner.model.cuda_graphs import DecodeGraphs, graph_batch_sizes, greedy_on_device
from runner.model.gpu_memory import profile_activation_bytes, profile_sequence_lengths
from runner.model.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# A fixed pool for the tiny models. Left to size itself, each CUDA engine takes
# gpu_memory_utilization of the whole GPU (~125 GiB on an H200), so a second engine built while
# the first is alive finds no room at all ("no room for the KV cache").
POOL = {"num_kv_blocks": 512}
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
    pytest.param("cuda", marks=cuda),
]


# ---------------------------------------------------------------- CPU: pure logic
def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]  # the cap itself is captured
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(10_000)[-1] == 512


def test_greedy_on_device() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    assert greedy_on_device(logits).tolist() == [1, 0]


def test_profile_sequence_lengths() -> None:
    assert profile_sequence_lengths(2048, 4096) == [2048]
    assert profile_sequence_lengths(10, 4) == [4, 4, 2]
    with pytest.raises(ValueError):
        profile_sequence_lengths(0, 4)


def test_profile_activation_bytes_is_zero_off_cuda(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, device="cpu").model
    assert profile_activation_bytes(model, 64, 512, 16, "cpu") == 0


# ---------------------------------------------------------------- decode graphs (CPU + CUDA)
def _decode_step(
    kv: KVStore, vocab: int, ctxs: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids [B], positions [B] and metadata of one decode step of sequences whose contexts
    (new token included) are ctxs, over blocks scattered at random in the store."""
    device = kv.device
    perm = torch.randperm(kv.num_blocks, generator=gen).tolist()
    tables = []
    for ctx in ctxs:
        n = -(-ctx // kv.block_size)
        tables.append(perm[:n])
        perm = perm[n:]
    meta = AttentionMetadata.build([1] * len(ctxs), ctxs, tables, kv.block_size, device)
    ids = torch.randint(3, vocab, (len(ctxs),), generator=gen).to(device)
    positions = torch.tensor([c - 1 for c in ctxs], device=device)
    return ids, positions, meta


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graphs_match_eager(make_tiny_model: Callable[..., Path], device: str) -> None:
    """Steps of 3, 1 and 4 rows replay the graphs of 4, 1 and 4 rows and give the eager step's
    logits and K/V: the static inputs are re-read at each replay, padding rows write nothing,
    and the fixed grid (max_model_len 2048: 4 partitions of 512 keys) covers any context."""
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        path = make_tiny_model("qwen3", max_position_embeddings=2048)
        model = load_model(path, device=device, dtype=dtype).model
        kv = KVStore(model.num_layers, 160, 16, model.num_kv_heads, model.head_dim, dtype, device)
        gen = torch.Generator().manual_seed(0)
        kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=gen).to(dtype))  # the prefixes
        graphs = DecodeGraphs(model, kv, 16, 4, 2048, device)
        graphs.capture()
        assert graphs.batch_sizes == [1, 2, 4]
        assert not graphs.can_run(5, 1) and not graphs.can_run(1, 129)
        for ctxs in ([5, 700, 130], [1300], [17, 300, 2, 1030]):
            ids, pos, meta = _decode_step(kv, model.vocab_size, ctxs, gen)
            assert graphs.can_run(len(ctxs), meta.block_tables.shape[1])
            kv_eager = copy.copy(kv)
            kv_eager.tensor = kv.tensor.clone()
            with torch.inference_mode():  # graphs use Triton whatever the engine's backend
                hidden = model(ids, pos, meta, kv_eager, attention_backend("triton"))
                ref = model.compute_logits(hidden)  # [B, vocab]
            got = graphs.run(ids, pos, meta)
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
            torch.testing.assert_close(kv.tensor, kv_eager.tensor, atol=tol, rtol=tol)


# ---------------------------------------------------------------- CUDA only
def _hf_greedy(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = hf.generate(
                ids, max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


PROMPTS = [list(range(3, 3 + n)) for n in (1, 9, 16, 33)] + [[7, 300, 11] * 20]


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_cuda_float32_matches_hf(
    make_tiny_model: Callable[..., Path], arch: str
) -> None:
    path = make_tiny_model(arch)
    refs = _hf_greedy(path, PROMPTS, 12)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for eager in (True, False):
        llm = LLM(
            str(path), device="cuda", dtype="float32", attention_backend="triton",
            enforce_eager=eager, **POOL,
        )  # fmt: skip
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == refs, f"eager={eager}"
        graphs = llm.runner.graphs
        assert (graphs is None) == eager  # and the decode steps went through the graphs:
        assert eager or (graphs is not None and graphs.num_replays > 0)
        del llm, graphs


@cuda
def test_engine_greedy_cuda_bf16_near_hf(make_tiny_model: Callable[..., Path]) -> None:
    """bf16 rounding may flip a near-tie, after which texts legitimately diverge; so check that
    each engine token is (nearly) HF's argmax given the engine's own prefix (teacher forcing)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("qwen3")
    llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend="triton", **POOL)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = hf.to("cuda").eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        full = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.inference_mode():
            logits = hf(full).logits[0, len(prompt) - 1 : -1].float()  # [12, vocab]
        chosen = logits.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen  # 0 where the engine picked HF's argmax
        tol = 2e-2 * logits.abs().max()
        assert (gap <= tol).all(), f"gaps {gap.tolist()} over tolerance {float(tol)}"


@cuda
def test_engine_uses_decode_graphs(make_tiny_model: Callable[..., Path]) -> None:
    """Once wired, a CUDA engine with Triton attention captures decode graphs by default."""
    llm = LLM(str(make_tiny_model("llama")), device="cuda", attention_backend="triton", **POOL)
    assert isinstance(getattr(llm.runner, "graphs", None), DecodeGraphs)


@cuda
def test_engine_samples_on_cuda(make_tiny_model: Callable[..., Path]) -> None:
    """Sampled requests on CUDA: unseeded ones draw their seed from the engine's (CUDA)
    generator, every filter runs on the device, and a seeded request repeats itself alone."""
    path = make_tiny_model("qwen3")
    llm = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton", **POOL)
    free = SamplingParams(
        max_tokens=8, temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, ignore_eos=True
    )
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3] + [PROMPTS[0]], [free, free, free, seeded])
    for out in outs:
        assert len(out.token_ids) == 8 and all(0 <= t < 320 for t in out.token_ids)
    assert llm.generate([PROMPTS[0]], seeded)[0].token_ids == outs[3].token_ids


@cuda
def test_kv_pool_sized_from_free_memory(make_tiny_model: Callable[..., Path]) -> None:
    """The pool takes gpu_memory_utilization of the GPU, less what is in use and what a full
    step's activations peak at; an engine sized so runs a batch within that share."""
    gc.collect()  # engines of earlier tests hold pools: they must be gone before "used" is read
    torch.cuda.empty_cache()
    path = make_tiny_model("llama")
    model = load_model(path, device="cuda").model
    act = profile_activation_bytes(model, 2048, 512, 16, "cuda", max_num_seqs=64)
    assert 0 < act < 1 << 30
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.2)
    shape = (model.num_layers, model.num_kv_heads, model.head_dim)
    free, total = torch.cuda.mem_get_info()
    blocks = kv_pool_blocks(
        config, num_layers=shape[0], num_kv_heads=shape[1], head_dim=shape[2],
        dtype=torch.bfloat16, max_model_len=512, device=torch.device("cuda"),
        activation_bytes=act,
    )  # fmt: skip
    per_block = KVStore.bytes_per_block(shape[0], 16, shape[1], shape[2], torch.bfloat16)
    assert blocks == (int(total * 0.2) - (total - free) - act) // per_block
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(str(path), device="cuda", gpu_memory_utilization=0.2)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    assert torch.cuda.max_memory_reserved() <= total * 0.2 + (1 << 30)


@cuda
def test_penalties_rules_and_logprobs_on_cuda(make_tiny_model: Callable[..., Path]) -> None:
    """Penalties, logit rules and log-probabilities (of outputs and of prompts) run on the
    device around the decode graphs (whose logits buffer they must not change): the same
    tokens and figures as the CPU engine."""
    path = make_tiny_model("llama")
    base = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    params = [
        dataclasses.replace(base, repetition_penalty=1.5),
        dataclasses.replace(base, frequency_penalty=1.0),
        dataclasses.replace(base, logprobs=5),
        dataclasses.replace(base, presence_penalty=1.5, logprobs=0),
        dataclasses.replace(base, prompt_logprobs=3),
        base,
        dataclasses.replace(base, logit_bias={5: 3.0, 9: -100.0}),
        dataclasses.replace(base, allowed_token_ids=[4, 8, 15, 16, 23, 42]),
        dataclasses.replace(base, stop_token_ids=[5], min_tokens=8, repetition_penalty=1.2),
    ]
    prompts = (PROMPTS * 2)[: len(params)]
    gpu = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton", **POOL)
    outs = gpu.generate(prompts, params)
    assert gpu.runner.graphs is not None and gpu.runner.graphs.num_replays > 0
    refs = LLM(str(path)).generate(prompts, params)
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        if ref.prompt_logprobs is not None:
            assert out.prompt_logprobs is not None
            for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
                assert got is not None and want is not None
                assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        if ref.logprobs is None:
            assert out.logprobs is None
            continue
        assert out.logprobs is not None
        for got, want in zip(out.logprobs, ref.logprobs, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]


@cuda
def test_structured_outputs_on_cuda(make_tiny_model: Callable[..., Path]) -> None:
    """xgrammar's bitmask applied to the device's logits (its CUDA kernel): the same tokens
    as the CPU engine, every finished answer inside its grammar."""
    pytest.importorskip("xgrammar")  # a GPU image may lack it, and has no network to get it
    path = make_tiny_model("llama", tokenizer=True)
    structure = StructuredOutputsParams(regex=r"(ab|c[de])+!")
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=2, structured_outputs=structure)
    prompts = PROMPTS[:3]
    gpu = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton", **POOL)
    outs = gpu.generate(prompts, params)
    refs = LLM(str(path)).generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(o.text.endswith("!") for o in outs if o.finish_reason == "stop")


@cuda
def test_speculative_decoding_on_cuda(make_tiny_model: Callable[..., Path]) -> None:
    """Drafted steps run eagerly beside the decode graphs: the same greedy tokens as the CPU
    engine without drafts, with guesses kept."""
    path = make_tiny_model("llama")
    prompts = [[7, 8, 9] * 8, [5, 300, 11, 12] * 5, *PROMPTS[:2]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    gpu = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        speculative_tokens=4,
        **POOL,
    )
    outs = gpu.generate(prompts, params)
    refs = LLM(str(path)).generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert gpu.stats()["num_accepted_tokens"] > 0
    # Seeded sampling: the same tokens as the same GPU engine's without guesses.
    seeded = SamplingParams(max_tokens=24, temperature=0.5, top_k=8, seed=9, ignore_eos=True)
    plain = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton", **POOL)
    assert [o.token_ids for o in gpu.generate(prompts, seeded)] == [
        o.token_ids for o in plain.generate(prompts, seeded)
    ]


@cuda
def test_tails_are_copied_on_cuda(make_tiny_model: Callable[..., Path]) -> None:
    """A prompt that repeats or extends a finished one computes only its new tokens, its
    partial block copied on the device: the same greedy tokens as transformers."""
    path = make_tiny_model("llama")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton", **POOL)
    first = llm.generate(PROMPTS, params)
    extended = [p + o.token_ids[:5] for p, o in zip(PROMPTS, first, strict=True)]
    refs = _hf_greedy(path, PROMPTS + extended, 12)
    outs = llm.generate(PROMPTS + extended, params)
    assert [o.token_ids for o in outs] == refs
    assert [o.num_cached_tokens for o in outs[: len(PROMPTS)]] == [len(p) - 1 for p in PROMPTS]
    assert llm.stats()["copied_tokens"] > 0
    llm.block_manager.check_integrity()


@cuda
def test_prefix_cache_file_on_cuda(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """A prefix cache saved from a CUDA engine warms another: the same tokens as a cold run
    (float32, so no rounding of the cached K/V can flip a near tie), the saved prefixes served
    from the cache."""
    path = make_tiny_model("qwen3")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    options = {"device": "cuda", "dtype": "float32", "attention_backend": "triton", **POOL}
    first = LLM(str(path), **options)
    cold = first.generate(PROMPTS, params)
    file = tmp_path / "prefix.safetensors"
    assert first.save_prefix_cache(file) > 0
    del first
    warm = LLM(str(path), **options)
    assert warm.load_prefix_cache(file) > 0
    outs = warm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert outs[-1].num_cached_tokens > 0
