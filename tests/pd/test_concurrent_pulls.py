"""Many pulls at once: each waits on its handover for as long as that prefill runs, so a decode
worker runs them on threads of their own, never queued behind each other (on the event loop's
default executor, six threads on two cores, the seventh waited for one of them to end)."""

from __future__ import annotations

import asyncio
import time

import httpx

from runner.disagg.held import HeldHandovers
from runner.disagg.zmq_transport import ZmqHandoverServer
from tests.pd.conftest import WorkerFactory

PULLS = 8


def test_pulls_waiting_on_open_handovers_all_run_at_once(worker: WorkerFactory) -> None:
    held = HeldHandovers(1 << 20)
    server = ZmqHandoverServer(held)
    ids = [f"h{i}" for i in range(PULLS)]
    for handover_id in ids:
        held.open(handover_id)  # prefills still running: their blocks not committed yet
    try:
        with worker("decode") as decode:

            async def pull(handover_id: str, client: httpx.AsyncClient) -> dict[str, object]:
                params = {
                    "transport": "zmq", "endpoint": server.endpoint, "handover_id": handover_id,
                    "prompt_token_ids": list(range(1, 100)), "cache_salt": handover_id,
                }  # fmt: skip
                answer = await client.post(f"{decode.url}/kvcache/pull", json=params)
                assert answer.status_code == 200, answer.text
                result: dict[str, object] = answer.json()
                return result

            async def run() -> tuple[int, list[dict[str, object]]]:
                async with httpx.AsyncClient(timeout=60) as client:
                    pulls = [asyncio.create_task(pull(i, client)) for i in ids]
                    most, deadline = 0, time.monotonic() + 10
                    while most < PULLS and time.monotonic() < deadline:
                        stats = (await client.get(f"{decode.url}/kvcache/disagg")).json()
                        most = max(most, stats["pulled"]["active"])
                        await asyncio.sleep(0.05)
                    for handover_id in ids:
                        held.finish(handover_id)  # the prefills end without those blocks
                    return most, list(await asyncio.gather(*pulls))

            most, results = asyncio.run(run())
            assert most == PULLS  # every pull was waiting at once
            assert all(r["blocks"] == 0 and "missing" in str(r["reason"]) for r in results)
            assert decode.parts.puller is not None and decode.parts.puller.active == 0
    finally:
        server.close()
