"""llama.cpp's `llama-server` as the single-replica comparison: found on PATH (or given),
started by the bench on a free loopback port with a GGUF file, waited for until its /health
says the model is loaded, and stopped by its own pid however the run ends."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.local_process import free_port, stop

START_TIMEOUT_S = 180.0
BINARY = "llama-server"


def find_llama_server(given: str | None) -> str | None:
    """The binary to run: `given` (which must be an executable file), else `llama-server`
    on PATH, else None (the comparison is skipped)."""
    if given is not None:
        path = Path(given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(f"--llama-server {given}: not an executable file")
        return str(path)
    return shutil.which(BINARY)


def server_command(binary: str, gguf: Path, port: int, slots: int, args: str) -> list[str]:
    """One slot per concurrent session (each with room for a long conversation), the same
    prompt cache behaviour llama-server has by default (cache_prompt on), then `args`."""
    ctx = slots * 4096
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(slots), "-c", str(ctx), "--alias", gguf.stem]
    return cmd + shlex.split(args)


@contextmanager
def running_llama_server(binary: str, gguf: Path, slots: int, args: str) -> Iterator[str]:
    """A started llama-server's base URL; its log's tail goes into the error if it dies."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        server_command(binary, gguf, port, slots, args), stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read()[-600:]
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {tail}")
            try:  # 503 while the model loads, 200 once it can answer
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.25)
        yield url
    finally:
        stop(proc, 10)
        log.close()
        os.unlink(log.name)
