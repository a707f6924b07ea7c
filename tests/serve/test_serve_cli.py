"""`kvcache serve` as a process: it starts from the command line with the engine's options, and
SIGTERM drains it: a running stream finishes whole, a new request meanwhile gets 503, and the
process then exits by itself with status 0."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx

from tests.redis_server import free_port
from tests.serve.processes import serve_process, wait_until_up


def test_sigterm_drains_then_exits(tiny_llama_tok_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model", str(tiny_llama_tok_dir), "--port", str(port)]
    proc = serve_process([*args, "--served-model-name", "tiny", "--num-kv-blocks", "64"])
    try:
        wait_until_up(proc, url)
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
