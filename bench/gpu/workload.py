"""What the GPU bench (bench/gpu/bench.py) runs: seeded random-weight models of real shapes,
built from their config (no download), and nano-vllm's benchmark workload."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from bench.workloads import BenchRequest

# name: (transformers class, hidden, intermediate, layers, heads, kv heads, head_dim, vocab,
# tied embeddings, rope theta, rms eps, max positions). Max positions 4096 is nano-vllm's
# max_model_len: it bounds the engine's per-sequence block table and decode-graph grid. "tiny"
# serves --quick and the greedy check.
SHAPES: dict[str, tuple[Any, ...]] = {
    "smollm2-135m": ("LlamaForCausalLM", 576, 1536, 30, 9, 3, 64, 49152, True, 1e5, 1e-5, 4096),
    "qwen3-0.6b": ("Qwen3ForCausalLM", 1024, 3072, 28, 16, 8, 128, 151936, True, 1e6, 1e-6, 4096),
    "tiny": ("Qwen3ForCausalLM", 64, 128, 2, 4, 2, 32, 320, False, 1e6, 1e-6, 512),
    "gemma3-270m": ("Gemma3ForCausalLM", 640, 2048, 18, 4, 1, 256, 262144, True, 1e6, 1e-6, 4096),
}
# What else a shape's config sets: Gemma 3 270M's five local layers of every six (its config's
# default pattern) attend to their last 512 tokens.
SHAPE_EXTRAS: dict[str, dict[str, Any]] = {
    "gemma3-270m": {"sliding_window": 512, "query_pre_attn_scalar": 256},
}
EOS_ID = 2


def vocab_size(shape: str) -> int:
    return int(SHAPES[shape][7])


def build_random_model(shape: str, folder: Path, dtype: torch.dtype, device: str) -> Path:
    """Save a seeded random model of `shape` (HF format, `dtype`) into `folder`.

    Weights are initialised on `device` (seconds on a GPU for 0.6B parameters, minutes on 2 CPU
    cores), then saved; the engine and transformers both load that folder."""
    import transformers

    cls_name, hidden, inter, layers, heads, kv_heads, head_dim, vocab, tied, theta, eps, max_pos = (
        SHAPES[shape]
    )
    cls = getattr(transformers, cls_name)
    config = cls.config_class(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        rope_theta=theta,
        rms_norm_eps=eps,
        max_position_embeddings=max_pos,
        # tiny: a big init and random norms give peaked logits (greedy ties would make token
        # equality a coin toss).
        initializer_range=0.1 if shape == "tiny" else 0.02,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        **SHAPE_EXTRAS.get(shape, {}),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype).eval()
    if shape == "tiny":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    del model
    return folder


def make_workload(
    num_seqs: int,
    min_len: int,
    max_input_len: int,
    max_output_len: int,
    token_range: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    """nano-vllm's bench.py workload: prompt lengths uniform in [min_len, max_input_len], ids
    uniform in token_range (inclusive), then output lengths uniform in [min_len,
    max_output_len], all from one seeded stream (prompts drawn first, as there)."""
    rng = random.Random(seed)
    lo, hi = token_range
    prompts = [
        [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_input_len))]
        for _ in range(num_seqs)
    ]
    outs = [rng.randint(min_len, max_output_len) for _ in range(num_seqs)]
    return [BenchRequest(str(i), p, n) for i, (p, n) in enumerate(zip(prompts, outs, strict=True))]
