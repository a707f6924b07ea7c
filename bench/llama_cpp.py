"""llama.cpp as a bench peer: a `llama-server` on a free port of 127.0.0.1, on the same GGUF the
engine loads, with one slot per request, its threads one per core; every prompt is sent at once
as token ids to its /completion endpoint, greedy, and the generated token ids come back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TypedDict

import httpx

from bench.local_process import free_port, stop
from bench.peers import PeerResult
from bench.workloads import BenchRequest

# Where the build in docs/BENCHMARKS.md puts the binary: tools/ beside the checkout.
DEFAULT_SERVER = (
    Path(__file__).resolve().parents[2] / "tools" / "llama.cpp" / "build" / "bin" / "llama-server"
)
START_TIMEOUT_S = 120.0


def find_llama_server(given: str | None) -> Path | str:
    """The llama-server to run: `given`, else one on PATH, else the documented build; a str
    says why there is none."""
    if given is not None:
        path = Path(given).expanduser()
        return path if path.is_file() and os.access(path, os.X_OK) else f"no executable {path}"
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    if DEFAULT_SERVER.is_file():
        return DEFAULT_SERVER
    return f"no llama-server on PATH nor at {DEFAULT_SERVER} (pass --llama-server PATH)"


def run_llama_cpp(server: Path, gguf: Path, requests: list[BenchRequest]) -> PeerResult:
    """Start the server, warm it up, send every request concurrently, stop it. TTFT is when the
    answer arrived less the server's own time for the tokens after the first
    (timings.predicted_ms): the answer is not streamed, since a streamed end-of-sequence token
    is never sent."""
    slots = len(requests)
    per_slot = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) + 16
    threads = len(os.sched_getaffinity(0))
    port = free_port()
    args = [
        str(server),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-np", str(slots), "-c", str(slots * per_slot), "-t", str(threads)),
        *("-tb", str(threads), "-ngl", "0", "--no-webui"),
    ]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=base, timeout=None) as client:
                _wait_ready(client, proc, log)
                _complete(client, [1, 2, 3, 4, 5], 2, False)  # warm-up; shares no prefix
                start = time.perf_counter()
                with ThreadPoolExecutor(max_workers=slots) as pool:
                    answers = list(
                        pool.map(
                            lambda r: _complete(
                                client, r.prompt_token_ids, r.max_tokens, r.ignore_eos
                            ),
                            requests,
                        )
                    )
                wall = time.perf_counter() - start
        finally:
            stop(proc, 10)
    outputs = [a["tokens"] for a, _ in answers]
    prefill = sum(int(a["timings"]["prompt_n"]) for a, _ in answers)
    ttft = [done - start - a["timings"]["predicted_ms"] / 1000 for a, done in answers]
    return PeerResult(outputs, wall, prefill, ttft)


class LlamaTimings(TypedDict):
    prompt_n: int  # prompt tokens computed (those not served from its cache)
    predicted_ms: float  # the answer's tokens, after the first


class LlamaAnswer(TypedDict):
    """The fields of llama-server's /completion answer that the bench reads."""

    tokens: list[int]
    timings: LlamaTimings


def _complete(
    client: httpx.Client, prompt: list[int], max_tokens: int, ignore_eos: bool
) -> tuple[LlamaAnswer, float]:
    """One greedy /completion of token ids; its answer and when it arrived."""
    body = {
        "prompt": prompt,
        "n_predict": max_tokens,
        "temperature": 0.0,  # llama.cpp samples greedily at temperature 0
        "top_k": 1,
        "ignore_eos": ignore_eos,
        "cache_prompt": True,
        "return_tokens": True,
        "stream": False,
    }
    answer = client.post("/completion", json=body)
    if answer.status_code != 200:
        raise RuntimeError(f"llama-server answered {answer.status_code}: {answer.text[:300]}")
    return answer.json(), time.perf_counter()


def _wait_ready(client: httpx.Client, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    """Until /health says the model is loaded; the server's log tail names a failure."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-800:]
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {tail}")
        try:
            if client.get("/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise RuntimeError(f"llama-server not ready after {START_TIMEOUT_S:.0f} s")


def gguf_of(model: str | None, model_dir: Path) -> Path | str:
    """The GGUF file the engine's weights came from (a str says why there is none): the default
    model's, a .gguf given as the model, or the one an HF folder was converted from."""
    if model is not None and Path(model).suffix.lower() == ".gguf":
        return Path(model).expanduser()
    source = model_dir / "kvcache_source.json"
    if source.is_file():
        gguf = Path(json.loads(source.read_text(encoding="utf-8"))["gguf"])
        return gguf if gguf.is_file() else f"its GGUF {gguf} is gone"
    return f"the model {model_dir} is an HF folder, not a GGUF"
