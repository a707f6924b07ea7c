"""vLLM's CPU build as a bench peer: bench/vllm_driver.py run by the Python of the venv
that holds it, on the HF folder the engine loaded (for the default GGUF, the folder it was
converted into), float32, greedy, prefix caching on, its OpenMP threads bound one per core that
this process may use."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from bench.peers import PeerResult
from bench.workloads import BenchRequest

DRIVER = Path(__file__).with_name("vllm_driver.py")
# Where docs/BENCHMARKS.md installs it: tools/ beside the checkout.
DEFAULT_PYTHON = Path(__file__).resolve().parents[2] / "tools" / "vllm-venv" / "bin" / "python"
# KV cache vLLM may hold, GiB: the bench's workloads need well under one.
KV_SPACE_GIB = 2
# Its start-up compiles kernels: minutes on a busy machine.
RUN_TIMEOUT_S = 1800.0


def find_vllm_python(given: str | None) -> Path | str:
    """The venv Python that imports vLLM: `given`, else the documented venv; a str says why
    there is none. It is not imported here: the driver fails with vLLM's own error if it is
    not there."""
    path = Path(given).expanduser() if given is not None else DEFAULT_PYTHON
    if not path.is_file():
        hint = "" if given is not None else " (pass --vllm-python PATH)"
        return f"no Python at {path}{hint}"
    return path


def bound_cores() -> str:
    """The cores this process may run on, as vLLM's VLLM_CPU_OMP_THREADS_BIND list ("0,1")."""
    return ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))


def run_vllm_cpu(
    python: Path, model_dir: Path, requests: list[BenchRequest], eos_ids: set[int]
) -> PeerResult:
    """Run the workload in a vLLM subprocess; its timings are its own (taken around its engine's
    steps, after its start-up and a warm-up), so start-up is not in the wall time."""
    job = {
        "model": str(model_dir),
        "eos_ids": sorted(eos_ids),
        "requests": [
            {"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "ignore_eos": r.ignore_eos}
            for r in requests
        ],
    }
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": bound_cores(),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    env.pop("PYTHONPATH", None)  # this project's path means nothing to the venv
    with tempfile.TemporaryDirectory(prefix="kvcache-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        # Its own session: vLLM starts an engine process and workers, and they all go on an
        # error, a timeout or ctrl-c here.
        proc = subprocess.Popen(
            [str(python), str(DRIVER), str(job_path), str(result_path)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            _kill_group(proc)
        if proc.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"vLLM driver exited with {proc.returncode}: {stderr[-1200:]}")
        result = json.loads(result_path.read_text(encoding="utf-8"))
    return PeerResult(
        [list(o) for o in result["outputs"]],
        float(result["wall_s"]),
        int(result["prefill_tokens"]),
        [float(t) for t in result["ttft_s"]],
    )


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the driver and every process it started (they share its session's group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone
    proc.wait()
