"""Sliding windows and soft caps across the attention backends, parametrized once: backend x
feature.

Every backend of runner/backends/registry.py ("torch", "cpu": the C kernels, "triton") runs the
same seeded random paged steps through its `attend` and must give the dense float64 reference
(tests/cpu_attention_cases.py): a query at position p sees keys p - W < j <= p only, and with a
cap c each score s = (q . k) * scale becomes c * tanh(s / c) before the mask and the softmax
(transformers' sliding_window_overlay and Gemma 2's attn_logit_softcapping). For Triton, the
keys no query of a sequence can see hold NaN: its kernels skip them, never read and mask them.
Caps are checked where they bite: queries five times a unit normal at scale 1 give scores of
10-100, and the capped reference is far from the plain one. The kernels' own paths (the CPU's
shared pass and C layers, Triton's partitions and tiles): tests/backends/cpu/test_cpu_features.py
and tests/backends/triton/test_triton_features.py. A backend that cannot run here is skipped:
"cpu" where its kernels cannot be built, "triton" without Triton, or on CPU tensors without
TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib.util
import os
from itertools import product
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.split import CpuSplit
from runner.backends.registry import paged_attention
from tests.cpu_attention_cases import Seq, backend_step


def _triton_runs() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


CPU = pytest.mark.skipif(load_cpu_kernels() is None, reason="no CPU kernels")
TRITON = pytest.mark.skipif(not _triton_runs(), reason="no Triton, or no interpreter")
BACKENDS = [pytest.param("torch"), pytest.param("cpu", marks=CPU)]
BACKENDS += [pytest.param("triton", marks=TRITON)]


def grid(cases: list[tuple[Any, ...]], triton: list[tuple[Any, ...]]) -> list[Any]:
    """Each case on "torch" and "cpu", and the `triton` cases on Triton (whose interpreter
    takes seconds a call: the cases the other two run, fewer of each kind)."""
    both = [pytest.param("torch", *c) for c in cases] + [
        pytest.param("cpu", *c, marks=CPU) for c in cases
    ]
    return both + [pytest.param("triton", *c, marks=TRITON) for c in triton]


# (window, soft cap): windows under a block, of a block, across block edges, of the longest
# context, past every context, of one token; caps of 5 and 50, alone and with windows; neither.
FEATURES: dict[str, tuple[int | None, float | None]] = {
    **{f"window-{w}": (w, None) for w in (1, 3, 7, 13, 16, 21, 100, 200)},
    "cap-5": (None, 5.0),
    "cap-50": (None, 50.0),
    **{f"window-{w}-cap-{c:g}": (w, c) for w, c in ((7, 5.0), (21, 5.0), (13, 50.0), (21, 50.0))},
    "neither": (None, None),
}
FEW = ["window-1", "window-3", "window-13", "window-100", "cap-5", "cap-50"]
FEW += ["window-13-cap-50", "window-21-cap-5", "neither"]
# Decodes over contexts of 1, a partial block, several blocks and 100 keys; with prefill
# chunks after cached prefixes and fresh prompts beside them.
DECODES: list[Seq] = [(1, 1), (1, 9), (1, 16), (1, 23), (1, 40), (1, 100)]
STEPS = {"decodes": DECODES, "mixed": DECODES[1:5] + [(37, 37), (20, 45), (3, 19), (16, 16)]}
SHAPES = [(4, 2, 2), (8, 4, 2), (16, 8, 2)]  # (block size, query heads, KV heads): GQA 1, 2, 4
# A window under one token; caps that are not positive finite numbers.
REFUSED = [(0, None, "window"), (-3, None, "window")]
REFUSED += [(None, cap, "cap") for cap in (0.0, -5.0, float("nan"), float("inf"))]
TOL = {torch.float32: 1e-4, torch.float16: 1e-4, torch.bfloat16: 3e-2}


def check(
    backend: str,
    seqs: list[Seq],
    shape: tuple[int, int, int],
    window: int | None,
    softcap: float | None,
    **options: Any,
) -> Any:
    """One step through `backend` against the reference: no NaN read, the reference's result,
    and, with a cap, far from the uncapped one (the cap bit). Returns the step."""
    block_size, hq, hkv = shape
    capped = {"scale": 1.0, "q_gain": 5.0} if softcap is not None else {}
    step = backend_step(
        backend, seqs, block_size, hq, hkv, 32, window, softcap, **capped, **options
    )
    assert not step.out.isnan().any(), "a key outside every window was read"
    tol = TOL[options.get("dtype", torch.float32)]
    torch.testing.assert_close(step.out.double(), step.reference(softcap), atol=tol, rtol=tol)
    if softcap is not None and window != 1:  # one key seen: its weight is 1, capped or not
        off = (step.out.double() - step.reference(None)).abs().max().item()
        bite = max(50 * TOL[torch.float32], 10 * tol)  # far beyond any doubt of rounding
        assert off > bite, f"the cap did not bite: {off} off the uncapped reference"
    return step


@pytest.mark.parametrize(
    ("backend", "feature", "kind", "shape"),
    grid(list(product(FEATURES, STEPS, SHAPES)), list(product(FEW, STEPS, SHAPES))),
)
def test_the_backend_gives_the_reference(
    backend: str, feature: str, kind: str, shape: tuple[int, int, int]
) -> None:
    seed = sum(shape) + len(feature)
    check(backend, STEPS[kind], shape, *FEATURES[feature], seed=seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", FEW)
def test_narrow_caches(backend: str, feature: str) -> None:
    """Float16 caches under float32 queries (kv_cache_dtype on the CPU: readers widen), and
    on Triton bfloat16 throughout."""
    narrow = {"dtype": torch.bfloat16} if backend == "triton" else {"cache_dtype": torch.float16}
    seqs: list[Seq] = [(1, 30), (1, 7), (24, 60), (5, 33), (40, 40)]
    check(backend, seqs, (4, 8, 2), *FEATURES[feature], seed=3, **narrow)


@pytest.mark.parametrize(
    ("backend", "window", "softcap", "narrow", "with_chunk"),
    grid(
        list(product([None, 1, 30, 48, 50, 64, 90, 200], [None, 5.0, 50.0], *[[False, True]] * 2)),
        list(product([None, 50, 200], [None, 5.0], [False], [False, True])),
    ),
)
def test_decodes_after_a_shared_prompt(
    backend: str, window: int | None, softcap: float | None, narrow: bool, with_chunk: bool
) -> None:
    """6 decodes x 4 query heads a KV head over a 5-block shared prompt (80 tokens): the torch
    path's cascade and the CPU decode kernel's shared pass read it once for all rows, which a
    window that starts inside it (on a block edge or not) must still cut, and a cap must cap;
    a window of 200 reaches key 0 (the pass may run). `narrow`: float16 caches."""
    decodes: list[Seq] = [(1, 81 + 7 * s) for s in range(6)]
    seqs = decodes + [(9, 100)] if with_chunk else decodes
    options: dict[str, Any] = {"cache_dtype": torch.float16} if narrow else {}
    step = check(backend, seqs, (16, 8, 2), window, softcap, shared_blocks=5, seed=5, **options)
    if backend == "cpu":
        split = step.meta._cpu_split
        assert isinstance(split, CpuSplit) and split.shared_blocks == 5  # the pass was offered


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_past_every_context_is_full_attention(backend: str) -> None:
    seqs: list[Seq] = [(1, 20), (12, 12), (4, 30)]
    windowed = check(backend, seqs, (4, 4, 2), 1000, None, seed=1).out
    full = check(backend, seqs, (4, 4, 2), None, None, seed=1).out
    if backend == "torch":  # the window cuts nothing, so the plain path runs
        assert torch.equal(windowed, full)


@pytest.mark.parametrize("backend", BACKENDS[:2])  # Triton's kernels are far off at 1e30
def test_a_cap_far_above_every_score_changes_next_to_nothing(backend: str) -> None:
    """c = 1e30: c * tanh(s / c) is s to within an ulp, so the uncapped result."""
    seqs: list[Seq] = [(1, 30), (1, 45), (12, 40), (33, 33)]
    step = backend_step(backend, seqs, 16, 4, 2, 32, None, 1e30, scale=1.0, q_gain=5.0, seed=9)
    torch.testing.assert_close(step.out.double(), step.reference(None), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("window", "softcap", "named"), REFUSED)
def test_bad_windows_and_caps_are_refused(
    backend: str, window: int | None, softcap: float | None, named: str
) -> None:
    """A window under one token, a cap that is not a positive finite number: ValueError
    naming it, through the registry's checked call, and through the kernels' own backends
    themselves (the torch path is handed only what the registry or a model checked)."""
    if backend != "torch":
        with pytest.raises(ValueError, match=named):
            backend_step(backend, [(1, 4), (3, 9)], 4, 2, 2, 16, window, softcap, hide=False)
    step_args = backend_step(backend, [(1, 4)], 4, 2, 2, 16, None, None, hide=False).inputs
    q, k, v, k_cache, v_cache, _, meta = step_args
    with pytest.raises(ValueError, match=named):
        paged_attention(q, k, v, k_cache, v_cache, meta, 1.0, backend, window, softcap)


@st.composite
def random_step(draw: st.DrawFn) -> dict[str, Any]:
    """A step's arguments: any head shape the kernels take, block size, window, cap, cache
    dtype and mix of decodes and chunks."""
    seqs: list[Seq] = []
    for _ in range(draw(st.integers(1, 6))):
        q_len = draw(st.sampled_from([1, 1, 2, 7, 16, 17, 33]))
        seqs.append((q_len, q_len + draw(st.integers(0, 45))))
    hkv = draw(st.integers(1, 2))
    return {
        "seqs": seqs,
        "block_size": draw(st.sampled_from([1, 4, 16])),
        "hq": hkv * draw(st.sampled_from([1, 2, 4])),
        "hkv": hkv,
        "d": draw(st.sampled_from([16, 48])),
        "window": draw(st.none() | st.integers(1, 70)),
        "softcap": draw(st.none() | st.sampled_from([1.0, 5.0, 20.0, 50.0])),
        "cache_dtype": draw(st.sampled_from([torch.float32, torch.float16])),
    }


@pytest.mark.parametrize("backend", BACKENDS[:2])  # Triton's interpreter is too slow for 60
@settings(max_examples=60, deadline=None)
@given(case=random_step())
def test_random_steps_give_the_reference(backend: str, case: dict[str, Any]) -> None:
    capped = {"scale": 1.0, "q_gain": 5.0} if case["softcap"] is not None else {}
    step = backend_step(backend, **case, **capped)
    torch.testing.assert_close(
        step.out.double(), step.reference(case["softcap"]), atol=1e-4, rtol=1e-4
    )
