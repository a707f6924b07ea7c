"""Compile the Triton kernels (attention, RMSNorm) for NVIDIA GPUs on a machine without one.

Triton compiles all the way to a cubin on the host (its wheels carry ptxas), so every launch the
CUDA runner makes can be compiled for an H100/H200 (sm_90) or an A100 (sm_80) in CI. A kernel
that would not compile there, or that asks for more shared memory than the chip has, fails here
instead of in the first minutes of a GPU lease; registers and local (spilled) memory per thread
come out of the cubin too, and the PTX says whether a kernel that must be exact in float32
(the fused residual-add norm and SiLU-times-up) compiled to approximate instructions.

The launches are the real ones: the kernel wrappers (store_kv, rope_store, prefill_attention,
decode_attention, rms_norm) run on CPU tensors with each kernel's launch recorded instead of
executed, and each recorded launch is specialised exactly as Triton's JIT would specialise it
(ints equal to 1 become constants, pointers and multiples of 16 get divisibility hints) before
it is compiled.

It must run with TRITON_INTERPRET=0: under the interpreter `@triton.jit` yields interpreted
functions, which cannot be compiled; `python -m runner.backends.triton.aot` sets it (so run it as a
process of its own) and prints one line per launch. tests/backends/triton/test_triton_compile.py
runs it so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Per-block shared memory limit (bytes, with the opt-in carve-out) of each compute capability.
SHARED_MEMORY_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
# Attention shapes (query heads, KV heads, head dim) of the models the CUDA runner is measured on.
MODEL_SHAPES = {
    "smollm2-135m": (9, 3, 64),
    "qwen3-0.6b": (16, 8, 128),
    "llama3-8b": (32, 8, 128),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function and the arguments it was called with."""

    kernel: Any  # triton.runtime.jit.JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Compiled:
    """Resources of one launch compiled for one architecture."""

    kernel: str
    case: str
    arch: int
    shared_bytes: int
    registers: int
    local_bytes: int  # per-thread local memory: register spills and stack
    seconds: float
    approximate: list[str]  # approximate float32 instructions in its PTX

    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_MEMORY_LIMIT[self.arch]

    def exact_enough(self) -> bool:
        """False for a kernel that must be exact in float32 (EXACT_IN_FLOAT32) compiled with
        approximate math for a float32 case."""
        exact = self.kernel in EXACT_IN_FLOAT32 and self.case.split()[1] == "float32"
        return not (exact and self.approximate)


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` records the call."""

    def __init__(self, kernel: Any, sink: list[Launch]) -> None:
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.sink.append(Launch(self.kernel, args, kwargs))

        return launch


@contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within the block, the runner's kernels record their launches instead of running."""
    import runner.backends.triton.attention as store_mod
    import runner.backends.triton.decode as decode_mod
    import runner.backends.triton.decode_prefix as prefix_mod
    import runner.backends.triton.decode_reduce as reduce_mod
    import runner.backends.triton.fused_elementwise as fused_mod
    import runner.backends.triton.prefill as prefill_mod
    import runner.backends.triton.rms_norm as norm_mod
    import runner.backends.triton.rope_store as rope_mod

    targets = [
        (store_mod, "_store_kv_kernel"),
        (rope_mod, "_rope_store_kernel"),
        (prefill_mod, "_prefill_kernel"),
        (decode_mod, "_decode_partition_kernel"),
        (reduce_mod, "_decode_reduce_kernel"),
        (prefix_mod, "_prefix_partition_kernel"),
        (norm_mod, "_rms_norm_kernel"),
        (fused_mod, "_add_rms_norm_kernel"),
        (fused_mod, "_silu_mul_kernel"),
    ]
    sink: list[Launch] = []
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    try:
        for module, name, kernel in saved:
            setattr(module, name, _Recorder(kernel, sink))
        yield sink
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def step_launches(
    shape: str,
    dtype: torch.dtype,
    block_size: int = 16,
    window: int | None = None,
    softcap: float | None = None,
) -> list[Launch]:
    """The launches of the runner's attention steps for one model shape and cache dtype: K/V
    store (alone, and with RoPE: rope_store.py), prefill over a cached prefix, decode in one
    partition and split into several, and a decode that reads a shared prefix once (its prefix
    pass, its query tile the widest). With a sliding `window` and / or a logit `softcap` the
    attention launches are those variants (a window shorter than DEFAULT_PARTITION_SIZE leaves
    the long decode in one partition). In 16 bits, the RMSNorms too: over whole rows, over the
    query heads, and scaling in float32; and the fused residual-add norm and SiLU-times-up
    (fused_elementwise.py)."""
    from runner.backends.torch.cascade import PrefixGroup
    from runner.backends.triton.attention import store_kv
    from runner.backends.triton.decode import DEFAULT_PARTITION_SIZE, decode_attention
    from runner.backends.triton.fused_elementwise import add_rms_norm, silu_mul
    from runner.backends.triton.prefill import prefill_attention
    from runner.backends.triton.rms_norm import rms_norm
    from runner.backends.triton.rope_store import rope_store
    from runner.backends.triton.shared_prefix import build_shared_prefix_plan, members_per_chunk

    num_q, num_kv, head_dim = MODEL_SHAPES[shape]
    blocks = 64
    k_cache = torch.zeros(blocks, block_size, num_kv, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(2, blocks, dtype=torch.int32)
    i32 = torch.int32
    with recorded_launches() as launches:
        kv = torch.zeros(40, num_kv, head_dim, dtype=dtype)
        store_kv(kv, kv, k_cache, v_cache, torch.zeros(40, dtype=torch.int64))
        q = torch.zeros(40, num_q, head_dim, dtype=dtype)
        table = torch.zeros(40, head_dim, dtype=dtype)
        rope_store(q, kv, kv, table, table, k_cache, v_cache, torch.zeros(40, dtype=torch.int64))
        starts, contexts = torch.tensor([0, 30, 40], dtype=i32), torch.tensor([90, 10], dtype=i32)
        variant: dict[str, Any] = {"window": window, "softcap": softcap}
        prefill_attention(q, k_cache, v_cache, starts, contexts, tables, 0.1, 30, **variant)
        short = torch.tensor([100, 3], dtype=i32)
        decode_attention(q[:2], k_cache, v_cache, short, tables, 0.1, 100, **variant)
        long = torch.tensor([DEFAULT_PARTITION_SIZE * 3, 3], dtype=i32)
        max_long = int(long.max())
        decode_attention(q[:2], k_cache, v_cache, long, tables, 0.1, max_long, **variant)
        members = members_per_chunk(num_q // num_kv, dtype)
        group = [PrefixGroup([0, 1], [0, 1, 2])]
        plan = build_shared_prefix_plan(group, 2, block_size, members, "cpu")
        decode_attention(
            q[:2], k_cache, v_cache, long, tables, 0.1, max_long, shared_prefix=plan, **variant
        )
        rows = q.view(40, num_q * head_dim)
        if dtype != torch.float32:  # a float32 norm alone is torch's own fused kernel
            rms_norm(rows, torch.ones(num_q * head_dim, dtype=dtype), 1e-6, False)
            rms_norm(q, torch.ones(head_dim, dtype=dtype), 1e-6, False)
            rms_norm(rows, torch.ones(num_q * head_dim), 1e-6, True)
        # The fused ones run in every dtype of a GPU step (float32 with exact math).
        add_rms_norm(rows, rows, torch.ones(num_q * head_dim, dtype=dtype), 1e-6, False)
        silu_mul(rows)
    return launches


# Approximate float32 instructions, as PTX spells them: Triton's tl.sqrt, its `/` and its
# tl.exp. CUDA's expf (libdevice) uses ex2.approx.ftz.f32 on a reduced argument, with its own
# corrections, so that form is not one of them.
APPROXIMATE = re.compile(r"\b(sqrt\.approx\.(?:ftz\.)?f32|rsqrt\.approx\.(?:ftz\.)?f32|"
                         r"div\.(?:full|approx)\.(?:ftz\.)?f32|ex2\.approx\.f32)\b")  # fmt: skip
# Kernels whose float32 results must be torch's within rounding: no approximate math in them.
EXACT_IN_FLOAT32 = {"add_rms_norm_kernel", "silu_mul_kernel"}


def approximate_ops(ptx: str) -> list[str]:
    """The approximate float32 instructions in a kernel's PTX, each once, sorted."""
    return sorted(set(APPROXIMATE.findall(ptx)))


def _cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes) per thread, as cuobjdump reads them from the cubin."""
    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage)
    if match is None:
        raise RuntimeError(f"cannot read resource usage from cuobjdump: {usage[-300:]}")
    return int(match.group(1)), int(match.group(2))


def compile_launch(launch: Launch, arch: int, case: str) -> Compiled:
    """Compile one recorded launch for sm_<arch>, specialised as the JIT would."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    kernel = launch.kernel
    names: list[str] = kernel.arg_names
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, name in enumerate(names):
        if index < len(launch.args):  # runtime argument: specialise it like the JIT does
            kind, key = native_specialize_impl(CUDABackend, launch.args[index], False, True, True)
            signature[name] = kind
            if kind == "constexpr":
                constexprs[name] = key
            elif key == "D":
                attrs[(index,)] = CUDABackend.parse_attr(key)
        else:
            signature[name] = "constexpr"
            constexprs[name] = launch.kwargs[name]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    start = time.perf_counter()
    # Launch options (num_warps) are keyword arguments of the launch, beside the constexprs.
    options = {
        k: v
        for k, v in launch.kwargs.items()
        if k in ("num_warps", "num_stages", "enable_fp_fusion")
    }
    binary = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    seconds = time.perf_counter() - start
    registers, local = _cubin_resources(binary.asm["cubin"])
    return Compiled(
        kernel=kernel.fn.__name__.lstrip("_"),
        case=case,
        arch=arch,
        shared_bytes=int(binary.metadata.shared),
        registers=registers,
        local_bytes=local,
        seconds=round(seconds, 2),
        approximate=approximate_ops(binary.asm["ptx"]),
    )


def compile_cases(
    cases: list[tuple[str, str]],
    arches: list[int],
    window: int | None = None,
    softcap: float | None = None,
    kernels: set[str] | None = None,
) -> Iterator[Compiled]:
    """Compile every launch of each (shape, dtype name) case for each architecture (of the
    `kernels` named, without the leading underscore, if given)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise RuntimeError("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled")
    for shape, dtype_name in cases:
        case = f"{shape} {dtype_name}" + ("" if window is None else f" window {window}")
        case += "" if softcap is None else f" softcap {softcap:g}"
        launches = step_launches(shape, DTYPES[dtype_name], window=window, softcap=softcap)
        for launch in launches:
            if kernels is not None and launch.kernel.fn.__name__.lstrip("_") not in kernels:
                continue
            for arch in arches:
                yield compile_launch(launch, arch, case)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(SHARED_MEMORY_LIMIT))
    parser.add_argument("--case", action="append", metavar="SHAPE:DTYPE")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--window", type=int, help="compile the sliding-window variants")
    parser.add_argument("--softcap", type=float, help="compile the logit soft-cap variants")
    parser.add_argument("--kernel", action="append", help="only these (e.g. silu_mul_kernel)")
    args = parser.parse_args(argv)
    # Before the kernel modules are imported: they would pick the interpreter on a CPU machine.
    os.environ["TRITON_INTERPRET"] = "0"
    arches = args.arch or [90]
    cases: list[tuple[str, str]] = [(shape, dtype) for shape in MODEL_SHAPES for dtype in DTYPES]
    if args.case:
        cases = [(c.partition(":")[0], c.partition(":")[2]) for c in args.case]
    for shape, dtype in cases:
        if shape not in MODEL_SHAPES or dtype not in DTYPES:
            parser.error(
                f"unknown case {shape}:{dtype}: shapes {list(MODEL_SHAPES)}, dtypes {list(DTYPES)}"
            )
    too_big = 0
    if args.window is not None and args.window < 1:
        parser.error(f"--window must be at least 1, got {args.window}")
    if args.softcap is not None and not 0.0 < args.softcap < float("inf"):
        parser.error(f"--softcap must be positive and finite, got {args.softcap}")
    only = set(args.kernel) if args.kernel else None
    for result in compile_cases(cases, arches, args.window, args.softcap, only):
        too_big += not result.fits() or not result.exact_enough()
        if args.json:
            print(json.dumps(asdict(result)), flush=True)
        else:
            print(
                f"sm_{result.arch} {result.case:<22} {result.kernel:<24} "
                f"smem {result.shared_bytes:>6} B  regs {result.registers:>3}  "
                f"local {result.local_bytes:>3} B  {'ok' if result.fits() else 'TOO BIG'}"
                + ("" if result.exact_enough() else f"  APPROXIMATE {result.approximate}"),
                flush=True,
            )
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main())
