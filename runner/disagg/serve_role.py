"""The hook `kvcache serve` starts its worker through (a `RoleStarter`, runner/serve/command.py):
pin the worker's CPUs, build its engine with the role's options, and give back the step that
adds the role's routes to the app. cli.py hands it to the serve command, so the server never
imports this package; it imports its parts (the transports, the routes and with them the web
stack) only when a worker starts, so that `kvcache --help` stays fast."""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from runner.serve.command import MakeEngine, StartedWorker, WorkerPlacement


def start_role(
    placement: WorkerPlacement, make_llm: MakeEngine, engine_options: dict[str, object]
) -> StartedWorker:
    """(the engine, app -> app with the role's routes). Raises ValueError naming a bad
    option."""
    from runner.disagg.cpus import pin_to_cpus
    from runner.disagg.roles import RoleOptions, build_role, engine_options_for
    from runner.disagg.routes import attach_role

    options = RoleOptions(role=placement.role, handover=placement.handover)
    if placement.cpus is not None:
        pin_to_cpus(placement.cpus)  # before the engine starts its threads
    llm = make_llm(engine_options_for(options, engine_options))
    parts = build_role(llm, options)
    atexit.register(parts.close)

    def attach(app: FastAPI) -> FastAPI:
        attach_role(app, parts)
        return app

    return llm, attach
