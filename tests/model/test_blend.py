"""Placing a segment's cached K/V at another position, and blending it (runner/model/blend.py),
against computing the same tokens at that position: every architecture, float32."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvcache import LLM
from runner.model.blend import BlendRegion, Placement, blend, compute_chunk, place
from tests.greedy_reference import ARCH_FIXTURES

BLOCK = 16
PREFIX, DOC = 37, 45  # positions: the prefix, then the document placed after it


def prefill(llm: LLM, tokens: list[int], start: int, table: list[int]) -> None:
    """Compute positions [start, start + len(tokens)) of a prompt whose earlier K/V are in
    `table`'s slots already."""
    with torch.no_grad():
        compute_chunk(llm.model, llm.kv, llm.attention, tokens, start, table)


def slots(table: list[int], lo: int, hi: int) -> torch.Tensor:
    pos = torch.arange(lo, hi)
    return torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK


def layer_kv(llm: LLM, layer: int, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = llm.kv.layer(layer)
    heads, dim, at = llm.kv.num_kv_heads, llm.kv.head_dim, at.to(llm.kv.device)
    return k.view(-1, heads, dim)[at].cpu(), v.view(-1, heads, dim)[at].cpu()


class Scene:
    """One model with three prompts' worth of blocks: the reference (prefix + document computed
    together), the document alone, and the blended prompt."""

    def __init__(
        self, path: Path, device: str = "cpu", attention_backend: str | None = None
    ) -> None:
        self.llm = LLM(
            str(path),
            num_kv_blocks=40,
            dtype="float32",
            device=device,
            attention_backend=attention_backend,
        )
        vocab = int(self.llm.hf_config.vocab_size)
        rng = random.Random(3)
        self.prefix = [rng.randrange(3, vocab) for _ in range(PREFIX)]
        self.doc = [rng.randrange(3, vocab) for _ in range(DOC)]
        self.ref_table, self.alone_table, self.table = (
            list(range(1, 7)),
            [7, 8, 9],
            [
                10,
                11,
                12,
                13,
                14,
                15,
            ],
        )
        prefill(self.llm, self.prefix + self.doc, 0, self.ref_table)
        prefill(self.llm, self.doc, 0, self.alone_table)
        prefill(self.llm, self.prefix, 0, self.table)
        self.dst = slots(self.table, PREFIX, PREFIX + DOC)
        self.ref = slots(self.ref_table, PREFIX, PREFIX + DOC)

    def place(self) -> None:
        src = slots(self.alone_table, 0, DOC)
        shift = torch.full((DOC,), PREFIX, dtype=torch.int64)
        place(self.llm.model, self.llm.kv, Placement(src, self.dst, shift))

    def region(self) -> BlendRegion:
        return BlendRegion(PREFIX, self.doc, [True] * DOC, [(0, DOC)], self.table)


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_placed_keys_equal_keys_computed_at_the_new_position(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """Layer 0's K/V depend on a token and its position only: placed, they are the K/V computed
    at the new position, to float32 rounding (partial rotary, layers without RoPE, layer types
    with their own frequencies and sliding windows included)."""
    scene = Scene(request.getfixturevalue(fixture))
    unplaced_k, _ = layer_kv(scene.llm, 0, scene.dst)
    scene.place()
    placed_k, placed_v = layer_kv(scene.llm, 0, scene.dst)
    ref_k, ref_v = layer_kv(scene.llm, 0, scene.ref)
    torch.testing.assert_close(placed_k, ref_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(placed_v, ref_v, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unplaced_k, ref_k, atol=1e-3)  # the slots held something else


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_phi3_dir", "tiny_gemma3_dir"])
def test_blending_everything_computes_the_prompt(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """Ratio 1 recomputes every reused token in every layer: the K/V of a full prefill, to
    rounding; ratio 0 leaves the deeper layers' cached K/V, which differ from them."""
    scene = Scene(request.getfixturevalue(fixture))
    model, layers = scene.llm.model, scene.llm.model.num_layers
    scene.place()
    assert blend(model, scene.llm.kv, scene.llm.attention, scene.region(), 0.0) == 0
    deep_k, _ = layer_kv(scene.llm, layers - 1, scene.dst)
    ref_k, ref_v = layer_kv(scene.llm, layers - 1, scene.ref)
    assert not torch.allclose(deep_k, ref_k, atol=1e-3)
    recomputed = blend(model, scene.llm.kv, scene.llm.attention, scene.region(), 1.0)
    assert recomputed == DOC
    for layer in range(layers):
        got_k, got_v = layer_kv(scene.llm, layer, scene.dst)
        ref_k, ref_v = layer_kv(scene.llm, layer, scene.ref)
        torch.testing.assert_close(got_k, ref_k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_v, ref_v, rtol=1e-4, atol=1e-4)


def test_a_partial_blend_recomputes_the_tokens_that_moved_most(tiny_llama_dir: Path) -> None:
    """Ratio 0.25 recomputes ceil(0.25 * 45) = 12 tokens, and the deepest layer's K/V come out
    nearer the full prefill's than with none recomputed."""
    scene = Scene(tiny_llama_dir)
    model, kv, last = scene.llm.model, scene.llm.kv, scene.llm.model.num_layers - 1
    ref_k, _ = layer_kv(scene.llm, last, scene.ref)
    errors = []
    for ratio in (0.0, 0.25):
        scene.place()
        recomputed = blend(model, kv, scene.llm.attention, scene.region(), ratio)
        assert recomputed == (12 if ratio else 0)
        got_k, _ = layer_kv(scene.llm, last, scene.dst)
        errors.append(float((got_k - ref_k).pow(2).sum()))
    assert errors[1] < errors[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_placing_and_blending_on_cuda(tiny_llama_dir: Path) -> None:
    """The same on a GPU, through the Triton backend (scripts/gpu_check.sh runs it)."""
    scene = Scene(tiny_llama_dir, "cuda")
    scene.place()
    torch.testing.assert_close(
        layer_kv(scene.llm, 0, scene.dst)[0],
        layer_kv(scene.llm, 0, scene.ref)[0],
        rtol=1e-4,
        atol=1e-4,
    )
    model, last = scene.llm.model, scene.llm.model.num_layers - 1
    assert blend(model, scene.llm.kv, scene.llm.attention, scene.region(), 1.0) == DOC
    got_k, _ = layer_kv(scene.llm, last, scene.dst)
    ref_k, _ = layer_kv(scene.llm, last, scene.ref)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-3, atol=1e-3)


def test_blending_through_the_triton_backend(tiny_llama_dir: Path) -> None:
    """The GPU's attention backend (in Triton's interpreter on the CPU): ratio 1 gives the K/V
    of a full prefill through the same backend."""
    pytest.importorskip("triton")
    scene = Scene(tiny_llama_dir, attention_backend="triton")
    scene.place()
    model, last = scene.llm.model, scene.llm.model.num_layers - 1
    assert blend(model, scene.llm.kv, scene.llm.attention, scene.region(), 1.0) == DOC
    got_k, got_v = layer_kv(scene.llm, last, scene.dst)
    ref_k, ref_v = layer_kv(scene.llm, last, scene.ref)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_v, ref_v, rtol=1e-4, atol=1e-4)
