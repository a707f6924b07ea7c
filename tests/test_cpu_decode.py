"""A decode step's layers in one C call (runner/cpu_decode.py, runner/csrc/decode_layers.c):
bit for bit what the modules compute, K/V writes included, and only where it applies. The
engine-level greedy equality with transformers (test_engine_equivalence.py) runs through it by
default and without it in the "no-cpu-kernels" variant."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from kvcache.store import KVStore
from runner.attention import AttentionMetadata
from runner.cpu_kernel_loader import load_cpu_kernels
from runner.cpu_prepack import prepack_for_cpu
from runner.loader import load_model
from runner.model import CausalLM

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)


def packed_llama(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> CausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
    )
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)  # not all ones, so a norm's scaling is exercised
    prepack_for_cpu(model)
    model.attention_backend = "cpu"
    return model


def decode_step(
    contexts: list[int], block_size: int, shared_blocks: int, seed: int
) -> tuple[AttentionMetadata, list[int]]:
    """One decode token per sequence, after `contexts[s] - 1` cached tokens; the first
    `shared_blocks` blocks of every table are the same (a shared prompt)."""
    rng = random.Random(seed)
    free = list(range(1 + shared_blocks, 512))
    rng.shuffle(free)
    tables = []
    for ctx in contexts:
        own = -(-ctx // block_size) - shared_blocks
        tables.append(list(range(1, 1 + shared_blocks)) + [free.pop() for _ in range(own)])
    meta = AttentionMetadata.build([1] * len(contexts), contexts, tables, block_size)
    tokens = [rng.randrange(96) for _ in contexts]
    return meta, tokens


@pytest.mark.parametrize(
    ("hidden", "heads", "kv_heads", "head_dim", "inter", "block_size", "num_seqs", "shared"),
    [
        (64, 4, 2, 16, 128, 16, 3, 0),
        (96, 6, 2, 32, 160, 4, 5, 0),
        (512, 8, 1, 64, 1024, 16, 2, 0),  # 2 KB rows: products read padded copies
        (128, 8, 1, 64, 256, 16, 4, 5),  # 4 x 8 query rows over a 5-block shared prefix
        (64, 16, 2, 16, 64, 8, 6, 9),
    ],
)
def test_decode_layers_match_the_modules_bit_for_bit(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    block_size: int,
    num_seqs: int,
    shared: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = packed_llama(hidden, heads, kv_heads, head_dim, inter)
    assert model.cpu_decode is not None
    calls: list[int] = []
    kernels = model.cpu_decode.kernels
    call = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: calls.append(a[1]) or call(*a))
    contexts = [shared * block_size + 1 + 7 * s for s in range(num_seqs)]
    meta, tokens = decode_step(contexts, block_size, shared, seed=hidden + num_seqs)
    kv = KVStore(2, 512, block_size, kv_heads, head_dim, torch.float32, "cpu")
    kv.tensor.normal_()  # the cached context
    kv_modules = KVStore(2, 512, block_size, kv_heads, head_dim, torch.float32, "cpu")
    kv_modules.tensor.copy_(kv.tensor)
    ids = torch.tensor(tokens)
    positions = torch.tensor([c - 1 for c in contexts])
    with torch.inference_mode():
        fused = model(ids, positions, meta, kv)
        split = meta._cpu_split
        assert split is not None and split.shared_blocks == shared
        step = AttentionMetadata.build(
            [1] * num_seqs, contexts, [list(map(int, row)) for row in meta.block_tables], block_size
        )
        decoder, model.cpu_decode = model.cpu_decode, None
        by_modules = model(ids, positions, step, kv_modules)
        model.cpu_decode = decoder
    assert calls == [num_seqs]  # the first step ran in C, the second through the modules
    assert torch.equal(fused, by_modules)
    assert torch.equal(kv.tensor, kv_modules.tensor)


def test_only_decode_steps_of_llama_shaped_packed_models_take_it(
    tiny_qwen2_dir: Path, tiny_qwen3_dir: Path
) -> None:
    model = packed_llama(64, 4, 2, 16, 128)
    kv = KVStore(2, 8, 4, 2, 16, torch.float32, "cpu")
    decodes = AttentionMetadata.build([1, 1], [3, 5], [[1], [2, 3]], 4)
    with_chunk = AttentionMetadata.build([1, 3], [3, 5], [[1], [2, 3]], 4)
    assert model.cpu_decode is not None
    assert model.cpu_decode.takes(decodes, kv, "cpu")
    assert not model.cpu_decode.takes(with_chunk, kv, "cpu")
    assert not model.cpu_decode.takes(decodes, kv, "torch")
    for path in (tiny_qwen2_dir, tiny_qwen3_dir):  # q/k/v biases; q/k norms
        other = load_model(str(path)).model
        prepack_for_cpu(other)
        assert other.cpu_decode is None
    unkernelled = load_model(str(tiny_qwen2_dir)).model
    prepack_for_cpu(unkernelled, cpu_kernels=False)
    assert unkernelled.cpu_decode is None
