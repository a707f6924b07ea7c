"""A step's layers in one C call (runner/model/cpu_layers.py,
runner/backends/cpu/csrc/layers.c): bit for bit what the modules compute, K/V writes included, for
decode steps, prefill chunks and mixes of both, and only where it applies. The engine-level greedy
equality with transformers (test_engine_equivalence.py) runs through it by default and without it
in the "no-cpu-kernels" variant."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from cpu_models import CpuModel, packed
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.split import CpuSplit
from runner.kv_pool.store import KVStore
from runner.model.decoder import CausalLM

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)

NUM_BLOCKS = 512


def packed_model(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    cpu_kernels: bool = True,
    arch: str = "llama",
    layers: int = 2,
) -> CpuModel:
    """A random model of `layers` layers packed for the CPU kernels, with its C layer stack.
    "llama-biases": every product with a bias; "qwen2": q/k/v biases; "qwen3": q/k norms."""
    torch.manual_seed(0)
    options = {
        "vocab_size": 96,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
    }
    if arch == "qwen2":
        assert head_dim * heads == hidden  # Qwen2 has no head_dim of its own
        config: Any = Qwen2Config(**options)
    elif arch == "qwen3":
        config = Qwen3Config(head_dim=head_dim, **options)
    else:
        biases = arch == "llama-biases"
        config = LlamaConfig(head_dim=head_dim, attention_bias=biases, mlp_bias=biases, **options)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # not all ones, so a norm's scaling is exercised
    return packed(model, cpu_kernels)


def one_step(
    seqs: list[tuple[int, int]],
    block_size: int,
    shared_blocks: int,
    seed: int,
    num_blocks: int = NUM_BLOCKS,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Block tables, token ids and positions of a step whose sequence s computes its last
    seqs[s][0] of seqs[s][1] tokens (the rest cached); the first `shared_blocks` blocks of
    every table are the same (a shared prompt)."""
    rng = random.Random(seed)
    free = list(range(1 + shared_blocks, num_blocks))
    rng.shuffle(free)
    tables, positions = [], []
    for q_len, ctx in seqs:
        own = -(-ctx // block_size) - shared_blocks
        tables.append(list(range(1, 1 + shared_blocks)) + [free.pop() for _ in range(own)])
        positions += range(ctx - q_len, ctx)
    tokens = torch.tensor([rng.randrange(96) for _ in positions])
    return tables, tokens, torch.tensor(positions)


STEPS = {
    "decodes": [(1, 9), (1, 17), (1, 40)],
    "prefill": [(37, 37), (20, 45)],  # a fresh prompt, and a chunk after a cached prefix
    "mixed": [(1, 30), (12, 12), (1, 7), (5, 70), (1, 52)],
}


@pytest.mark.parametrize(
    ("hidden", "heads", "kv_heads", "head_dim", "inter", "block_size"),
    [
        (64, 4, 2, 16, 128, 16),
        (96, 6, 2, 32, 160, 4),
        (512, 8, 1, 64, 1024, 16),  # 2 KB rows: products read padded copies
        (64, 16, 2, 16, 64, 8),
    ],
)
@pytest.mark.parametrize("kind", list(STEPS))
def test_layers_in_c_match_the_modules_bit_for_bit(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    block_size: int,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_against_modules(
        packed_model(hidden, heads, kv_heads, head_dim, inter),
        STEPS[kind],
        block_size,
        shared_blocks=0,
        monkeypatch=monkeypatch,
    )


@pytest.mark.parametrize("with_chunk", [False, True])
def test_decodes_after_a_shared_prompt_match_the_modules(
    with_chunk: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 x 8 query rows over a 5-block shared prefix: the decode kernel's shared pass, alone
    and beside a prefill chunk."""
    decodes = [(1, 5 * 16 + 1 + 7 * s) for s in range(4)]
    seqs = decodes + [(9, 5 * 16 + 20)] if with_chunk else decodes
    model = packed_model(128, 8, 1, 64, 256)
    split = check_against_modules(model, seqs, 16, shared_blocks=5, monkeypatch=monkeypatch)
    assert split.shared_blocks == 5


@pytest.mark.parametrize(
    ("arch", "hidden", "heads", "kv_heads", "head_dim"),
    [("qwen2", 64, 4, 2, 16), ("qwen3", 64, 4, 2, 32), ("llama-biases", 96, 6, 3, 16)],
)
@pytest.mark.parametrize("kind", ["decodes", "mixed"])
def test_biases_and_per_head_norms_match_the_modules(
    arch: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen2's q/k/v biases, a Llama with every product biased, Qwen3's q and k normed per head
    before RoPE: the same in C as in the modules."""
    model = packed_model(hidden, heads, kv_heads, head_dim, 96, arch=arch)
    check_against_modules(model, STEPS[kind], 8, shared_blocks=0, monkeypatch=monkeypatch)


def check_against_modules(
    cpu_model: CpuModel,
    seqs: list[tuple[int, int]],
    block_size: int,
    shared_blocks: int,
    monkeypatch: pytest.MonkeyPatch,
    num_blocks: int = NUM_BLOCKS,
) -> CpuSplit:
    """Run one step in C and the same step through the modules, on equal caches of
    `num_blocks` blocks; both the hidden states and the caches must be equal. Returns the
    step's CpuSplit."""
    model, layers = cpu_model
    assert layers is not None
    calls: list[int] = []
    run = layers.kernels.run_layers
    monkeypatch.setattr(layers.kernels, "run_layers", lambda *a: calls.append(a[1]) or run(*a))
    tables, ids, positions = one_step(seqs, block_size, shared_blocks, len(seqs), num_blocks)
    kv_heads, head_dim = model.num_kv_heads, model.head_dim
    caches = [
        KVStore(model.num_layers, num_blocks, block_size, kv_heads, head_dim, torch.float32, "cpu")
        for _ in range(2)
    ]
    caches[0].tensor.normal_()  # the cached context
    caches[1].tensor.copy_(caches[0].tensor)
    outs: list[torch.Tensor] = []
    splits: list[CpuSplit | None] = []
    with torch.inference_mode():
        for kv, in_c in zip(caches, (True, False), strict=True):
            meta = AttentionMetadata.build(
                [q for q, _ in seqs], [c for _, c in seqs], tables, block_size
            )
            outs.append(model(ids, positions, meta, kv, cpu_model.backend(in_c)))
            splits.append(meta._cpu_split)
    assert splits[0] is not None
    assert calls == [len(ids)]  # the first step ran in C, the second through the modules
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].tensor, caches[1].tensor)
    return splits[0]


def test_only_packed_models_on_the_cpu_backend_take_it() -> None:
    stack = packed_model(64, 4, 2, 16, 128).stack
    kv = KVStore(2, 8, 4, 2, 16, torch.float32, "cpu")
    assert stack is not None
    assert stack.takes(kv)
    assert not stack.takes(KVStore(2, 8, 512, 2, 16, torch.float32, "cpu"))
    for layers, kv_heads, head_dim in ((3, 2, 16), (2, 4, 16), (2, 2, 32)):  # not this model's
        other = KVStore(layers, 8, 4, kv_heads, head_dim, torch.float32, "cpu")
        assert not stack.takes(other)
    assert packed_model(64, 4, 2, 16, 128, cpu_kernels=False).stack is None
    assert packed_model(64, 4, 2, 16, 120).stack is None  # the SiLU's 7.5 vectors a row


@st.composite
def model_and_step(draw: st.DrawFn) -> dict[str, Any]:
    """A small model the C path takes (any GQA ratio the decode kernel does, head sizes 16 to
    256, padded 2 KB rows where a width is 512) and a step of decodes and prefill chunks, each
    after a random cached prefix (sometimes a whole number of blocks), sometimes all after a
    shared prompt long enough for the decode kernel's shared pass."""
    group, kv_heads = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    # transformers wants the hidden size a multiple of the head count (and C of 16)
    if not [n for n in range(16, 257, 16) if n % (group * kv_heads) == 0]:
        kv_heads = 1
    heads = group * kv_heads
    head_dim = draw(st.sampled_from([16, 32, 48, 64, 128, 256]))
    arch = draw(st.sampled_from(["llama", "llama-biases", "qwen2", "qwen3"]))
    if arch == "qwen2" and heads * head_dim > 256:  # its hidden size is its heads' width
        arch = "llama"
    sizes = [n for n in range(16, 257, 16) if n % heads == 0]
    hidden = heads * head_dim if arch == "qwen2" else draw(st.sampled_from(sizes))
    inter = draw(st.sampled_from([16, 48, 96, 512]) | st.integers(1, 32).map(lambda n: 16 * n))
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    shared_blocks = -(-64 // block_size) + draw(st.integers(0, 2)) if draw(st.booleans()) else 0
    seqs = []
    # decodes only (the decode kernel straight on q), chunks only, or both
    kind = draw(st.sampled_from(["decodes", "chunks", "mixed"]))
    count = draw(st.integers(1, 8))
    # Often enough decode rows (16) for the shared pass, when there is a shared prompt.
    decodes = max(2, -(-16 // group)) if shared_blocks and draw(st.booleans()) else 0
    total = max(count, decodes + 1, 2) if kind == "mixed" else max(count, decodes)
    for i in range(total):
        if kind == "mixed":  # a decode first, a chunk last, either between
            chunk = i == total - 1 or (i > max(0, decodes - 1) and draw(st.booleans()))
        else:
            chunk = kind == "chunks" and i >= decodes
        q_len = draw(st.integers(2, 40)) if chunk else 1
        cached = shared_blocks * block_size + draw(st.integers(0, 50))
        if draw(st.booleans()):  # the context ends exactly at a block's end
            cached += -(cached + q_len) % block_size
        seqs.append((q_len, cached + q_len))
    shape = (hidden, heads, kv_heads, head_dim, inter)
    layers = draw(st.integers(1, 2))
    return {
        "shape": shape,
        "arch": arch,
        "layers": layers,
        "seqs": seqs,
        "block": block_size,
        "shared": shared_blocks,
    }


# ~1.5 s: small models run a step in milliseconds; 50 examples reach the rarer cases (a
# shared pass beside a chunk) in most runs.
@settings(max_examples=50, deadline=None)
@given(case=model_and_step())
def test_random_models_and_steps_match_the_modules_bit_for_bit(case: dict[str, Any]) -> None:
    """Hidden states and every layer's K/V written, bit for bit, for any shape and step."""
    seqs, block_size, shared = case["seqs"], case["block"], case["shared"]
    hidden, heads, kv_heads, head_dim, inter = case["shape"]
    model = packed_model(
        hidden, heads, kv_heads, head_dim, inter, True, case["arch"], case["layers"]
    )
    # Room for every table plus some, so the blocks scatter over the pool.
    blocks = 1 + sum(-(-ctx // block_size) for _, ctx in seqs) + 8
    with pytest.MonkeyPatch.context() as monkeypatch:
        split = check_against_modules(model, seqs, block_size, shared, monkeypatch, blocks)
    decodes = sum(q == 1 for q, _ in seqs)
    if shared and decodes >= 2 and decodes * heads // kv_heads >= 16:
        assert split.shared_blocks == shared  # the decode kernel's shared pass ran


def test_scratch_of_a_long_step_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of over 256 tokens gets scratch of its own; the steps around it, one token
    included, still match the modules with the kept (smaller) scratch."""
    model = packed_model(64, 4, 2, 16, 128)
    layers = model.stack
    assert layers is not None
    check_against_modules(model, [(1, 9), (3, 20)], 4, 0, monkeypatch)
    kept = layers._scratch
    check_against_modules(model, [(1, 40), (300, 310)], 4, 0, monkeypatch)
    assert layers._scratch is kept
    check_against_modules(model, [(1, 1)], 4, 0, monkeypatch)
    assert layers._scratch is kept
