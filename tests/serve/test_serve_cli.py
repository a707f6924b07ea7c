"""`kvcache serve` as a process: it starts from the command line with the engine's options, and
SIGTERM drains it: a running stream finishes whole, a new request meanwhile gets 503, and the
process then exits by itself with status 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_sigterm_drains_then_exits(tiny_llama_tok_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(REPO / "cli.py"), "serve", "--model", str(tiny_llama_tok_dir)]
    command += ["--port", str(port), "--served-model-name", "tiny", "--num-kv-blocks", "64"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": "tiny", "prompt": "a", "max_tokens": 400, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            late = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=10)
            assert late.status_code == 503, late.text
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == 400, "the running request was not let finish"
        assert first.startswith("data: ")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
