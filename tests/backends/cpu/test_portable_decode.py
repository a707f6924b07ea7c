"""The portable decode attention kernel (runner/backends/cpu/portable.py) against the dense
float64 reference: every group size it takes, head sizes with and without a constant-size
instance, blocks of one token and of many, windows, contexts of one key, of a block and one,
and long; scattered block tables; and, through the torch path, a step that mixes decodes with
prefill chunks. It builds wherever there is a C compiler, AVX-512 or not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from runner.attention.backend import AttentionCall
from runner.backends.cpu import attention as cpu_attention
from runner.backends.cpu import loader
from runner.backends.cpu.portable import PORTABLE_SOURCES, PortableDecode, load_portable_decode
from runner.backends.torch.paged import torch_paged_attention, write_kv
from tests.cpu_attention_cases import Seq, prepared_step

PORTABLE = load_portable_decode()
needs_build = pytest.mark.skipif(PORTABLE is None, reason="no C compiler here")
DECODES: list[Seq] = [(1, 1), (1, 17), (1, 300), (1, 33), (1, 16)]


def _kernel() -> PortableDecode:
    assert PORTABLE is not None
    return PORTABLE


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_it_compiles_from_scratch(tmp_path: Path) -> None:
    target = tmp_path / "portable.so"
    try:
        loader._build("cc", target, PORTABLE_SOURCES)
    except subprocess.CalledProcessError as err:
        pytest.fail(f"the portable kernel does not build:\n{err.stderr}")
    assert target.stat().st_size > 0


@needs_build
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [8, 64, 80, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decodes_match_the_reference(group: int, d: int, block_size: int) -> None:
    scale = d**-0.5
    step = prepared_step(DECODES, block_size, 2 * group, 2, d, None, scale=scale, seed=group)
    x = step.inputs
    write_kv(x.k, x.v, x.k_cache, x.v_cache, x.meta.slot_mapping)
    out = _kernel().decode_attention(
        x.q, x.k_cache, x.v_cache, x.meta.block_tables, x.meta.context_lens, scale
    )
    torch.testing.assert_close(out.double(), step.reference(None), atol=2e-5, rtol=1e-4)


@needs_build
@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
def test_a_window_reads_only_its_keys(window: int) -> None:
    """The keys before each window are NaN in the cache: read, they would poison the row."""
    step = prepared_step(DECODES, 16, 6, 2, 64, window, scale=0.125, seed=window, hide=True)
    x = step.inputs
    write_kv(x.k, x.v, x.k_cache, x.v_cache, x.meta.slot_mapping)
    out = _kernel().decode_attention(
        x.q, x.k_cache, x.v_cache, x.meta.block_tables, x.meta.context_lens, 0.125, window
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), step.reference(None), atol=2e-5, rtol=1e-4)


@needs_build
@pytest.mark.parametrize("window", [None, 13])
def test_the_torch_path_hands_it_the_decodes_of_a_mixed_step(window: int | None) -> None:
    seqs: list[Seq] = [(1, 50), (5, 40), (1, 3), (30, 30), (1, 200), (20, 90)]
    step = prepared_step(seqs, 16, 9, 3, 64, window, scale=0.125, seed=7, hide=False)
    x = step.inputs
    decode = _kernel().decode_attention
    copies = (x.k_cache.clone(), x.v_cache.clone())
    call = AttentionCall(x.q, x.k, x.v, *copies, x.meta, 0.125, window)
    with_kernel = torch_paged_attention(call, decode)
    torch.testing.assert_close(with_kernel.double(), step.reference(None), atol=2e-5, rtol=1e-4)
    alone = torch_paged_attention(
        AttentionCall(x.q, x.k, x.v, x.k_cache, x.v_cache, x.meta, 0.125, window)
    )
    torch.testing.assert_close(with_kernel, alone, atol=2e-5, rtol=1e-4)


@needs_build
def test_an_empty_context_gives_a_zero_row() -> None:
    caches = [torch.randn(2, 16, 1, 64) for _ in range(2)]
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.tensor([0, 5], dtype=torch.int32)
    out = _kernel().decode_attention(torch.randn(2, 2, 64), *caches, tables, lens, 0.125)
    assert out[0].eq(0).all() and out[1].abs().sum() > 0


@needs_build
def test_shapes_it_does_not_take_are_refused() -> None:
    kernel = _kernel()
    q, cache = torch.randn(1, 2, 64), torch.randn(2, 16, 1, 64)
    assert kernel.supported(q, cache)
    assert not kernel.supported(torch.randn(1, 2, 12), torch.randn(2, 16, 1, 12))  # head 12
    assert not kernel.supported(q, cache.half())  # a float16 cache: torch's path reads it
    assert not kernel.supported(torch.randn(1, 9, 64), cache)  # 9 query heads a KV head
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot take"):
        kernel.decode_attention(torch.randn(1, 9, 64), cache, cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.decode_attention(q, cache.transpose(0, 1), cache, tables, lens, 0.125)


@needs_build
def test_the_cpu_backend_decodes_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the AVX-512 library cannot run, the cpu backend's decodes go to this kernel."""
    calls: list[int] = []
    kernel = _kernel()

    class Counting(PortableDecode):
        def __init__(self) -> None:
            self._decode = kernel._decode

        def decode_attention(self, q: torch.Tensor, *args: object) -> torch.Tensor:
            calls.append(q.shape[0])
            return super().decode_attention(q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_attention, "load_portable_decode", Counting)
    monkeypatch.setattr(cpu_attention, "load_cpu_kernels", lambda: None)  # as on an AVX2 CPU
    seqs: list[Seq] = [(1, 40), (8, 8), (1, 70)]
    step = prepared_step(seqs, 16, 4, 2, 64, None, scale=0.125, hide=False)
    x = step.inputs
    out = cpu_attention.cpu_paged_attention(
        AttentionCall(x.q, x.k, x.v, x.k_cache, x.v_cache, x.meta, 0.125)
    )
    assert calls == [2]  # the two decodes, in one call
    torch.testing.assert_close(out.double(), step.reference(None), atol=2e-5, rtol=1e-4)
