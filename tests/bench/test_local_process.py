"""The bench's local server processes: a free port can be bound, and `stop` ends a process
that exits on SIGTERM and kills one that ignores it, reaping both."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from bench.local_process import free_port, stop


def test_a_free_port_can_be_bound() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_stop_terminates_and_kills_what_ignores_it() -> None:
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop(polite, 10)
    assert polite.returncode is not None
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    stop(stubborn, 0.2)
    assert stubborn.returncode == -9
    stubborn.stdout.close()
