"""A Redis server for the tier figures: the URL given, or, for ``auto``, Debian's redis-server
started on a free loopback port without persistence and stopped when the figure is done."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench.local_process import free_port, stop

AUTO = "auto"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_url(spec: str | None, timeout_s: float = 10.0) -> Iterator[str | None]:
    """``spec`` as it is (None: no Redis rows), or for ``auto`` the URL of a server of our own
    for the block. Raises ValueError for anything else, RuntimeError when the server does not
    start."""
    if spec is None or spec != AUTO:
        if spec is not None and not spec.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis takes redis://host:port/db or {AUTO!r}, got {spec!r}")
        yield spec
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("--redis auto needs redis-server on the PATH (apt install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", workdir]
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers(port):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop(server, 10)
