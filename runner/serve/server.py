"""Running the app under uvicorn, with a drain on SIGTERM: new requests get 503 at once,
running ones finish (up to a timeout, then they are aborted), and only then does the server
stop. Ctrl-C stops it as uvicorn does."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from runner.serve.app import ServerState
from runner.serve.head_deadline import HEAD_TIMEOUT_S, head_bounded_protocol

DRAIN_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGTERM drains `state` before it exits."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True  # the routes answer 503 from now on
            threading.Thread(target=self._drain, name="kvcache-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # stopped as asked: not re-raised after the shutdown

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.state.engine.live() and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        self.state.engine.stop()  # aborts whatever outlived the timeout, so its calls end
        self.should_exit = True


def run_server(
    app: FastAPI,
    host: str,
    port: int,
    drain_timeout_s: float,
    log_level: str = "warning",
    access_log: bool = True,
    head_timeout_s: float = HEAD_TIMEOUT_S,
) -> None:
    """Serve `app` (from build_app) on host:port until SIGTERM (drained) or Ctrl-C; uvicorn's
    `log_level` and `access_log` as vLLM's --uvicorn-log-level and
    --disable-uvicorn-access-log set them; a request head slower than `head_timeout_s` gets a
    408 (head_deadline.py)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        http=head_bounded_protocol(head_timeout_s),
    )
    DrainingServer(config, app.state.serve, drain_timeout_s).run()
