"""The server processes a bench starts on this machine: a free loopback port to give one, and
its stop however the run ends (a server that ignores SIGTERM is killed)."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop(process: subprocess.Popen[bytes], wait_s: float) -> None:
    """Terminate `process` and reap it, killing it when it has not exited within `wait_s`."""
    process.terminate()
    try:
        process.wait(wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
