"""`kvcache serve` as a process started from the command line, for the tests that need one:
its start with this checkout first on the path, and the wait until its /health answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def serve_process(args: list[str]) -> subprocess.Popen[str]:
    """`cli.py serve ARGS`, its stderr piped (read it when it fails)."""
    command = [sys.executable, str(REPO / "cli.py"), "serve", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)


def wait_until_up(proc: subprocess.Popen[str], url: str, timeout_s: float = 60.0) -> None:
    """Until the server at `url` answers /health with 200; fails with its stderr if it exits,
    and after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
