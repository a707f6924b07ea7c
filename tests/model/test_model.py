"""Our CausalLM against transformers' own model on the same weights: full prefill, prefill
in chunks through the paged store, decode step by step and mixed batches."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_models import of_engine
from transformers import AutoModelForCausalLM, LlamaConfig

from kvcache import LLM
from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.loader import load_cpu_kernels
from runner.kv_pool.store import KVStore
from runner.model.decoder import CausalLM
from runner.model.loader import load_model

ARCH_DIRS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]


class Driver:
    """A minimal model runner: block tables from a shuffled free list, one forward per
    step over any mix of (sequence, new tokens) chunks; returns every row's logits."""

    def __init__(self, model: CausalLM, block_size: int = 8, num_blocks: int = 96) -> None:
        self.model, self.block_size = model, block_size
        dtype = model.embed_tokens.weight.dtype
        self.kv = KVStore(
            model.num_layers,
            num_blocks,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            dtype,
            "cpu",
        )
        self.free = list(range(1, num_blocks))  # block 0 is what padded tables point at
        random.Random(0).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        q_lens, ctxs, tables, ids, positions = [], [], [], [], []
        for sid, tokens in chunks:
            start = self.lengths.get(sid, 0)
            ctx = start + len(tokens)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < ctx:
                table.append(self.free.pop())
            self.lengths[sid] = ctx
            q_lens.append(len(tokens))
            ctxs.append(ctx)
            tables.append(table)
            ids += tokens
            positions += range(start, ctx)
        meta = AttentionMetadata.build(q_lens, ctxs, tables, self.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv)
        logits = self.model.compute_logits(hidden)  # [T, vocab] float32
        return list(logits.split(q_lens))


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module", params=ARCH_DIRS)
def pair(request: pytest.FixtureRequest) -> tuple[CausalLM, Any]:
    """(our model, HF's model) loaded from the same tiny checkpoint."""
    path: Path = request.getfixturevalue(request.param)
    ours = load_model(str(path)).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


def test_prefill_matches_hf(pair: tuple[CausalLM, Any]) -> None:
    ours, hf = pair
    tokens = random_tokens(45, seed=1)
    (logits,) = Driver(ours).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("first", "block_size"), [(20, 8), (16, 8), (5, 4), (30, 16)])
def test_two_chunk_prefill_equals_one_pass(
    pair: tuple[CausalLM, Any], first: int, block_size: int
) -> None:
    ours, hf = pair
    tokens = random_tokens(47, seed=2)
    one = Driver(ours, block_size).step([(0, tokens)])[0]
    driver = Driver(ours, block_size)
    a = driver.step([(0, tokens[:first])])[0]
    b = driver.step([(0, tokens[first:])])[0]  # attends to chunk one through the table
    torch.testing.assert_close(torch.cat([a, b]), one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, hf_logits(hf, tokens)[first:], atol=1e-4, rtol=1e-4)


def test_decode_step_by_step_matches_hf(pair: tuple[CausalLM, Any]) -> None:
    ours, hf = pair
    tokens = random_tokens(30, seed=3)
    ref = hf_logits(hf, tokens)
    driver = Driver(ours, block_size=4)
    rows = [driver.step([(0, tokens[:10])])[0]]
    rows += [driver.step([(0, [t])])[0] for t in tokens[10:]]
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-4, rtol=1e-4)


def test_mixed_batch_matches_hf(pair: tuple[CausalLM, Any]) -> None:
    """One step holding decodes, a long chunk after a prefix, a fresh prefill and a short
    suffix after a prefix; each sequence's rows equal HF's on that sequence alone."""
    ours, hf = pair
    seqs = {i: random_tokens(n, seed=10 + i) for i, n in enumerate([25, 60, 19, 33, 12])}
    driver = Driver(ours, block_size=8)
    driver.step([(0, seqs[0][:24]), (1, seqs[1][:21]), (3, seqs[3][:30]), (4, seqs[4][:11])])
    chunks = [
        (0, seqs[0][24:]),  # decode
        (1, seqs[1][21:]),  # long chunk after a 21-token prefix
        (2, seqs[2]),  # fresh prefill
        (3, seqs[3][30:]),  # 3-token suffix after a prefix
        (4, seqs[4][11:]),  # decode
    ]
    out = driver.step(chunks)
    for (sid, new), logits in zip(chunks, out, strict=True):
        ref = hf_logits(hf, seqs[sid])[-len(new) :]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4, msg=f"sequence {sid}")


def test_llama3_rope_scaling_matches_hf(make_tiny_model: Callable[..., Path]) -> None:
    scaling = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = make_tiny_model("llama", rope_parameters=scaling)
    ours = load_model(str(path)).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = random_tokens(100, seed=4)
    (logits,) = Driver(ours, num_blocks=32).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_default_model_matches_hf(default_model_dir: Path) -> None:
    loaded = load_model(None)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tokens = loaded.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    driver = Driver(loaded.model, block_size=16, num_blocks=16)
    first = driver.step([(0, tokens[:-3])])[0]
    rest = [driver.step([(0, [t])])[0] for t in tokens[-3:]]
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(torch.cat([first, *rest]), ref, atol=2e-4, rtol=1e-4)
    assert loaded.tokenizer.decode(int(ref[-1].argmax())).strip() == "Rome"


def test_bfloat16_model_close_to_float32(tiny_llama_dir: Path) -> None:
    tokens = random_tokens(40, seed=6)
    f32 = Driver(load_model(str(tiny_llama_dir)).model).step([(0, tokens)])[0]
    bf16_model = load_model(str(tiny_llama_dir), dtype=torch.bfloat16).model
    assert bf16_model.rope_cos.dtype == torch.bfloat16
    bf16 = Driver(bf16_model).step([(0, tokens)])[0]
    assert bf16.dtype == torch.float32  # logits are always float32
    torch.testing.assert_close(bf16, f32, atol=0.15, rtol=0.05)


def test_compute_logits_only_for_given_rows(tiny_qwen2_dir: Path) -> None:
    model = load_model(str(tiny_qwen2_dir)).model
    hidden = torch.randn(3, model.hidden_size)
    logits = model.compute_logits(hidden)
    assert logits.shape == (3, model.vocab_size) and logits.dtype == torch.float32


def test_unknown_architecture_is_named() -> None:
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        CausalLM(config)


@pytest.mark.parametrize("rope_type", ["dynamic"])  # longrope: tests/model/test_rotary.py
def test_unsupported_rope_scaling_is_refused(rope_type: str) -> None:
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match=rope_type):
        CausalLM(config)


def test_load_hf_state_dict_checks_names_and_shapes(tiny_llama_dir: Path) -> None:
    model = load_model(str(tiny_llama_dir)).model
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    state = dict(hf.state_dict())
    model.load_hf_state_dict(state)  # round trip works
    missing = {k: v for k, v in state.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="missing"):
        model.load_hf_state_dict(missing)
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_hf_state_dict(bad)
    extra = dict(state)
    extra["model.layers.0.self_attn.mystery.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="mystery"):
        model.load_hf_state_dict(extra)


@pytest.mark.parametrize(
    ("arch", "seed"), [("mistral", 5), ("phi3", 6), ("granite", 7), ("smollm3", 8), ("olmo2", 9)]
)
def test_each_architecture_matches_hf(
    make_tiny_model: Callable[..., Path], arch: str, seed: int
) -> None:
    """Same logits as transformers' own model, over each one's particulars: Phi-3 holds q/k/v
    and gate/up fused on disk (loaded whole), Granite's four multipliers are far from 1 here,
    SmolLM3 leaves RoPE out of its second layer, OLMo 2 norms q and k across heads and each
    branch on its way out."""
    path = make_tiny_model(arch)
    ours = load_model(str(path)).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = random_tokens(30, seed=seed)
    (logits,) = Driver(ours).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_architecture_particulars_reach_the_c_layers(make_tiny_model: Callable[..., Path]) -> None:
    """What the C layers are told: SmolLM3's layers without RoPE, OLMo 2's post-norm layout."""
    smollm3 = LLM(str(make_tiny_model("smollm3"))).model
    assert [layer.self_attn.use_rope for layer in smollm3.layers] == [True, False]
    olmo2 = of_engine(LLM(str(make_tiny_model("olmo2"))))
    assert olmo2.model.architecture == "Olmo2ForCausalLM"
    if load_cpu_kernels() is not None:  # the C layers build (AVX-512)
        assert olmo2.stack is not None and olmo2.stack.post_norm
    else:
        assert olmo2.stack is None


def test_olmo2_norms_round_as_transformers_does_in_bfloat16(
    make_tiny_model: Callable[..., Path],
) -> None:
    """OLMo 2 scales its norms in float32 before rounding: in bfloat16 our norms give exactly
    transformers' numbers, where the other order would be one rounding apart."""
    path = make_tiny_model("olmo2")
    ours = load_model(str(path), dtype=torch.bfloat16).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    mine, theirs = (
        ours.layers[0].post_attention_layernorm,
        hf.model.layers[0].post_attention_layernorm,
    )
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(64).bfloat16() * 3)
        mine.weight.copy_(theirs.weight)
        assert torch.equal(mine(x), theirs(x))
