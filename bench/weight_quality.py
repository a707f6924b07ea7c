"""What rounding the weights or the KV cache costs a model: perplexity with each
`cpu_weight_dtype`, and with `kv_cache_dtype="float16"`.

`python -m bench.weight_quality [--model PATH] [--tokens N] [FILE ...]` reads text (by
default the project's own docs), and prints the perplexity of transformers' float32 model on it
with its weight matrices as they are, rounded to bfloat16, quantized to int8 as
runner/backends/cpu/quant.py rounds them, and rounded to bfloat16 with every product's input
rounded too (`round_product_inputs`), quantized to int8 with every product's input quantized too
(`quantize_product_inputs`), then with float32 weights and a cache that rounds each key
and value to float16 (`Float16KV`): the very models the CPU engine runs with those options (its
greedy output equals transformers' on them; tests/model/test_rounded_weights.py,
tests/model/test_bfloat16_dot.py, tests/model/test_kv_cache_dtype.py).
"""

from __future__ import annotations

import argparse
import inspect
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from runner.backends.cpu.quant import quantize_rows, round_matrices
from runner.engine.config import CPU_WEIGHT_DTYPES

DOCS = Path(__file__).resolve().parents[1] / "docs"
WINDOW = 1024  # tokens scored per forward pass; each window starts fresh


class Float16KV(DynamicCache):
    """transformers' cache, holding each new key and value rounded to float16 (as float32):
    what the engine's float16 KV cache holds, attended to in float32 as the engine does."""

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,  # transformers' own, passed through whole
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rounded = (key_states.half().float(), value_states.half().float())
        return super().update(*rounded, layer_idx, *args, **kwargs)


def float16_kv(model: PreTrainedModel) -> dict[str, Float16KV]:
    """A fresh Float16KV as the keyword this transformers takes (`cache` in 5.x, where
    `past_key_values` is deprecated; `past_key_values` before)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: Float16KV(config=model.config)}


def round_product_inputs(model: nn.Module) -> None:
    """Make every nn.Linear of `model` round its input to bfloat16 (kept as float32) before
    its product. With the weights rounded to bfloat16 too, each product is then a float32 sum
    of exact products of bfloat16 values: what `cpu_weight_dtype="bfloat16-dot"` computes (in
    another order of the sum)."""

    def rounded(_: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0].to(torch.bfloat16).float(), *args[1:])

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(rounded)


def quantize_product_inputs(model: nn.Module) -> None:
    """Make every nn.Linear of `model` quantize its input rows to int8 (one scale a row, kept as
    float32) before its product: with the weights quantized per column too, what
    `cpu_weight_dtype="int8-dot"` computes (its int32 sums are exact)."""

    def quantized(_: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (quantize_rows(args[0]), *args[1:])

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(quantized)


def perplexity(model_dir: Path, ids: torch.Tensor, dtype: str, kv16: bool = False) -> float:
    """exp(mean next-token loss) over ids [T], in windows of WINDOW tokens; with `kv16`, each
    window's keys and values rounded to float16 as they are cached."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    round_matrices(model, dtype)
    if dtype == "bfloat16-dot":
        round_product_inputs(model)
    if dtype == "int8-dot":
        quantize_product_inputs(model)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, WINDOW):
            window = ids[start : start + WINDOW + 1][None]
            predicted = window.shape[1] - 1
            cache = float16_kv(model) if kv16 else {}
            total += float(model(window, labels=window, **cache).loss) * predicted
            count += predicted
    return math.exp(total / count)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="text to score; default: docs/*.md")
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: SmolLM2")
    parser.add_argument("--tokens", type=int, default=4096, help="score the first N tokens")
    args = parser.parse_args(argv)
    from kvcache import LLM

    model_dir = LLM(args.model, num_kv_blocks=16).model_path  # resolves and converts once
    files = args.files or sorted(DOCS.glob("*.md"))
    text = "\n\n".join(Path(f).read_text(encoding="utf-8") for f in files)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, return_tensors="pt").input_ids[0][: args.tokens]
    print(f"{len(ids)} tokens of {', '.join(Path(f).name for f in files)}")
    base = None
    for dtype in CPU_WEIGHT_DTYPES:
        value = perplexity(model_dir, ids, dtype)
        base = base or value
        print(f"{dtype:12s} perplexity {value:8.3f}  ({(value / base - 1) * 100:+.2f}%)")
    assert base is not None
    value = perplexity(model_dir, ids, "float32", kv16=True)
    print(
        f"{'kv16':12s} perplexity {value:8.3f}  ({(value / base - 1) * 100:+.2f}%)  float32 "
        "weights, keys and values rounded to float16"
    )


if __name__ == "__main__":
    main()
