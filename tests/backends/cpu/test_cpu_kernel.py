"""The panel kernel (runner/backends/cpu/csrc/panel_gemm.c): equal to F.linear for any shape, bias
and row count (one tile, several, a partial last tile or panel, a prefill-sized batch), the same
result for a row whatever shares its call, and a clean fallback to oneDNN where it cannot be
built."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.backends.cpu import loader as cpu_kernel_loader
from runner.backends.cpu.kernel import CpuKernels
from runner.backends.cpu.linear import PackedLinear, onednn_available
from runner.backends.cpu.loader import load_cpu_kernels

needs_kernel = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)


@pytest.fixture
def kernel() -> CpuKernels:
    loaded = load_cpu_kernels()
    assert loaded is not None
    return loaded


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 70),
    in_features=st.integers(1, 130),
    out_features=st.integers(1, 130),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_panel_product_equals_f_linear(
    rows: int, in_features: int, out_features: int, bias: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    kernel = load_cpu_kernels()
    assert kernel is not None
    out = kernel.matmul(x, kernel.pack(weight), b, out_features)
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


@needs_kernel
def test_pack_pads_the_last_panel_with_zeros(kernel: CpuKernels) -> None:
    weight = torch.randn(20, 7)  # 20 columns: one full panel of 16 and one of 4
    packed = kernel.pack(weight)
    assert packed.shape == (2, 7, 16)
    assert torch.equal(packed[0], weight[:16].t())
    assert torch.equal(packed[1, :, :4], weight[16:].t())
    assert not packed[1, :, 4:].any()


@needs_kernel
def test_a_large_batch_with_a_partial_last_tile(kernel: CpuKernels) -> None:
    # 300 rows: 18 tiles of 16, then 12 rows in a pass of their own; all land in their rows.
    weight = torch.randn(40, 2048)
    x = torch.randn(300, 2048)
    out = kernel.matmul(x, kernel.pack(weight), None, 40)
    torch.testing.assert_close(out, F.linear(x, weight), atol=2e-4, rtol=1e-4)


@needs_kernel
def test_a_row_gets_the_same_bits_in_any_batch(kernel: CpuKernels) -> None:
    weight = torch.randn(96, 576)
    packed = kernel.pack(weight)
    x = torch.randn(37, 576)  # two full tiles of 16 and a partial one
    batch = kernel.matmul(x, packed, None, 96)
    for row in (0, 15, 16, 36):
        alone = kernel.matmul(x[row : row + 1], packed, None, 96)
        assert torch.equal(batch[row : row + 1], alone)


@needs_kernel
def test_shapes_strides_and_empty_inputs(kernel: CpuKernels) -> None:
    weight = torch.randn(24, 32)
    packed = kernel.pack(weight)
    x = torch.randn(32, 3, 5).permute(1, 2, 0)  # [3, 5, 32], not contiguous
    torch.testing.assert_close(kernel.matmul(x, packed, None, 24), F.linear(x, weight))
    assert kernel.matmul(torch.randn(0, 32), packed, None, 24).shape == (0, 24)
    bias = torch.randn(24)
    empty_sum = kernel.matmul(torch.randn(2, 0), kernel.pack(torch.randn(24, 0)), bias, 24)
    assert torch.equal(empty_sum, bias.expand(2, 24))
    with pytest.raises(TypeError, match="float32"):
        kernel.matmul(x.double(), packed, None, 24)


@needs_kernel
def test_packed_linear_uses_the_kernel_unless_told_not_to() -> None:
    weight = torch.randn(8, 8)
    assert PackedLinear(weight, None).backend == "panel"
    if onednn_available():
        assert PackedLinear(weight, None, panel_kernel=False).backend == "onednn"


@pytest.fixture
def fresh_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """load_cpu_kernels() with an empty cache directory, and the process's loader restored."""
    monkeypatch.setenv("KVCACHE_CACHE_DIR", str(tmp_path))
    load_cpu_kernels.cache_clear()
    yield
    load_cpu_kernels.cache_clear()


@needs_kernel
def test_the_library_is_built_once_and_then_reused(fresh_loader: None, tmp_path: Path) -> None:
    assert load_cpu_kernels() is not None
    built = list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    load_cpu_kernels.cache_clear()
    assert load_cpu_kernels() is not None
    assert built[0].stat().st_mtime_ns == stamp


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"])
def test_without_a_working_compiler_products_fall_back_to_onednn(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch, compiler: str
) -> None:
    monkeypatch.setenv("CC", compiler)  # missing, or one that fails every build
    assert load_cpu_kernels() is None
    if onednn_available():
        weight = torch.randn(8, 8)
        layer = PackedLinear(weight, None)
        assert layer.backend == "onednn"
        x = torch.randn(3, 8)
        torch.testing.assert_close(layer(x), F.linear(x, weight))


def test_each_cpu_gets_its_own_build() -> None:
    # A cache directory shared between machines must not hand one CPU another's instructions.
    assert cpu_kernel_loader._cpu_fingerprint()
    assert cpu_kernel_loader.library_path("flags: avx512f") != cpu_kernel_loader.library_path(
        "flags: avx2"
    )


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 80),
    dim=st.sampled_from([16, 64, 576, 2048]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_equals_transformers_formula(rows: int, dim: int, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen) * scale
    weight = torch.randn(dim, generator=gen)
    kernel = load_cpu_kernels()
    assert kernel is not None
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(kernel.rms_norm(x, weight, 1e-5), expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 80),
    width=st.sampled_from([16, 48, 1536]),
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul_equals_torch(rows: int, width: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 8  # reaches silu's flat tails
    gate_up[0, :4] = torch.tensor([-200.0, -88.5, 88.5, 200.0])  # past exp's float range
    kernel = load_cpu_kernels()
    assert kernel is not None
    gate, up = gate_up.split(width, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(kernel.silu_and_mul(gate_up), expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_rowwise_kernels_refuse_what_they_cannot_take(kernel: CpuKernels) -> None:
    assert kernel.rowwise_supported(torch.zeros(2, 32), 32)
    assert not kernel.rowwise_supported(torch.zeros(2, 24), 24)  # not a multiple of 16
    assert not kernel.rowwise_supported(torch.zeros(2, 32, dtype=torch.float64), 32)


@needs_kernel
def test_rows_2kb_apart_and_strided_rows(kernel: CpuKernels) -> None:
    # 1,024-float rows alias in the L1 cache: the kernel reads them from a padded copy.
    weight = torch.randn(48, 1024)
    x = torch.randn(40, 1024)
    torch.testing.assert_close(
        kernel.matmul(x, kernel.pack(weight), None, 48), F.linear(x, weight), atol=2e-4, rtol=1e-4
    )
    # A view whose rows are further apart than their length is read in place.
    wide = torch.randn(20, 48)
    view = wide[:, :32]
    small = torch.randn(24, 32)
    torch.testing.assert_close(
        kernel.matmul(view, kernel.pack(small), None, 24), F.linear(view, small)
    )
