"""One worker process of the disaggregation bench (bench.py): `python -m
bench.pd_interference_worker --port P --role R [--cpus C] [--options JSON] [--model M]`, a
`kvcache serve` whose engine options are given as JSON (the bench's systems set some that
the serve command has no flag for, such as enable_chunked_prefill)."""

from __future__ import annotations

import argparse
import json

from runner.disagg.serve_role import start_role
from runner.serve.command import WorkerPlacement


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", default="both")
    parser.add_argument("--handover", default="zmq")
    parser.add_argument("--cpus", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args()

    from runner.engine.api.frozen_heap import freeze_server_heap
    from runner.engine.api.llm import LLM
    from runner.serve.app import ServeSettings, build_app
    from runner.serve.server import run_server

    # Metrics off unless the bench asks (engine-pd's workers record their schedules).
    options = {"record_metrics": False, "prefault_kv_cache": True} | json.loads(args.options)
    make = lambda o: LLM(args.model, **o)  # noqa: E731
    llm, attach = start_role(WorkerPlacement(args.role, args.handover, args.cpus), make, options)
    freeze_server_heap()
    app = attach(build_app(llm, ServeSettings("bench", max_queued_requests=4096)))
    run_server(app, "127.0.0.1", args.port, 5.0)


if __name__ == "__main__":
    main()
