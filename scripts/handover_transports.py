"""The direct handover's transport, measured: ZeroMQ (what runner/disagg/zmq_transport.py uses)
against torch.distributed's gloo, each moving one long prompt's block values from a "prefill"
process on CPU 0 to a "decode" process on CPU 1 over loopback; and, for scale, the same blocks
read back from a redis-server on CPU 0 (the Redis handover's pull), where one is installed.

    python scripts/handover_transports.py [--blocks 129] [--value-bytes 737555] [--repeats 5]

The defaults are pd_interference's 2,078-token prompt on the default model (129 full blocks of
737,555 bytes, float32 K/V). Each pull asks for the blocks ``chunk`` at a time and copies each
one that arrives into a preallocated pool (as a pull copies a checked block into the decode
worker's pool); the figures are the pull's wall time and the decode process's CPU time, the
median of ``--repeats`` pulls, for chunks of 1 and 16 blocks. ZeroMQ runs our own server and
client (HeldHandovers behind a ROUTER socket, REQ asking by hash); gloo runs the same exchange
as tensors: a request (first block, count), the values' sizes, then one send a value, received
into one reused buffer (gloo needs the receiver to know each size first).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from bench.local_process import free_port


def _values(blocks: int, value_bytes: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, value_bytes, dtype=np.uint8).tobytes() for _ in range(blocks)]


def _zmq_prefill(endpoint_out: Any, blocks: int, value_bytes: int, done: Any) -> None:
    os.sched_setaffinity(0, {0})
    from runner.disagg.held import HeldHandovers
    from runner.disagg.zmq_transport import ZmqHandoverServer

    held = HeldHandovers(capacity_bytes=4 * blocks * value_bytes)
    held.hold("h", list(range(1, blocks + 1)), _values(blocks, value_bytes))
    server = ZmqHandoverServer(held)
    endpoint_out.put(server.endpoint)
    done.wait()
    server.close()


def _zmq_decode(endpoint: str, blocks: int, value_bytes: int, chunk: int) -> tuple[float, float]:
    from runner.disagg.zmq_transport import ZmqHandoverClient

    pool = np.empty((blocks, value_bytes), dtype=np.uint8)
    client = ZmqHandoverClient(endpoint)
    wall, cpu = time.perf_counter(), time.process_time()
    at = 0
    for values in client.fetch("h", list(range(1, blocks + 1)), chunk):
        for value in values:
            assert value is not None
            pool[at] = np.frombuffer(value, dtype=np.uint8)
            at += 1
        del values
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    client.close()
    assert at == blocks
    return wall, cpu


def _redis_decode(url: str, blocks: int, value_bytes: int, chunk: int) -> tuple[float, float]:
    from kvcache.tiers import BlockSpec
    from runner.disagg.redis_transport import RedisHandover

    spec = BlockSpec("transport-bench", "float32", 4, 1, 16, 1, 16)
    handover = RedisHandover(url, spec)
    pool = np.empty((blocks, value_bytes), dtype=np.uint8)
    wall, cpu = time.perf_counter(), time.process_time()
    at = 0
    for values in handover.fetch(list(range(1, blocks + 1)), chunk):
        for value in values:
            assert value is not None
            pool[at] = np.frombuffer(value, dtype=np.uint8)
            at += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    handover.close()
    assert at == blocks
    return wall, cpu


def _redis_rows(blocks: int, size: int, chunks: tuple[int, ...], repeats: int) -> dict[
    tuple[str, int], list[tuple[float, float]]
]:  # fmt: skip
    import shutil

    from bench.local_redis import AUTO
    from bench.local_redis import redis_url as local_redis
    from kvcache.tiers import BlockSpec
    from runner.disagg.cpus import thread_on_cpus
    from runner.disagg.redis_transport import RedisHandover

    if shutil.which("redis-server") is None:
        return {}
    rows = {}
    with thread_on_cpus({0}), local_redis(AUTO) as url:
        assert url is not None
        spec = BlockSpec("transport-bench", "float32", 4, 1, 16, 1, 16)
        writer = RedisHandover(url, spec)
        writer.publish(list(range(1, blocks + 1)), _values(blocks, size))
        writer.close()
        with thread_on_cpus({1}):
            for chunk in chunks:
                _redis_decode(url, blocks, size, chunk)  # warm-up
                rows[("redis", chunk)] = [_redis_decode(url, blocks, size, chunk)
                                          for _ in range(repeats)]  # fmt: skip
    return rows


def _gloo_worker(rank: int, port: int, blocks: int, value_bytes: int, plan: list[int],
                 out: Any) -> None:  # fmt: skip
    os.sched_setaffinity(0, {rank})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    if rank == 0:  # the prefill side: answers (first, count) requests until (-1, 0)
        held = [
            torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in _values(blocks, value_bytes)
        ]
        request = torch.zeros(2, dtype=torch.int64)
        while True:
            dist.recv(request, src=1)
            first, count = (int(x) for x in request)
            if first < 0:
                break
            dist.send(torch.tensor([held[i].numel() for i in range(first, first + count)]), dst=1)
            for i in range(first, first + count):
                dist.send(held[i], dst=1)
    else:
        pool = np.empty((blocks, value_bytes), dtype=np.uint8)
        buffer = torch.empty(value_bytes, dtype=torch.uint8)
        results = []
        for chunk in plan:
            wall, cpu = time.perf_counter(), time.process_time()
            for first in range(0, blocks, chunk):
                count = min(chunk, blocks - first)
                dist.send(torch.tensor([first, count], dtype=torch.int64), dst=0)
                sizes = torch.zeros(count, dtype=torch.int64)
                dist.recv(sizes, src=0)
                for i in range(count):
                    if int(sizes[i]) != buffer.numel():
                        buffer = torch.empty(int(sizes[i]), dtype=torch.uint8)
                    dist.recv(buffer, src=0)
                    pool[first + i] = buffer.numpy()
            results.append((chunk, time.perf_counter() - wall, time.process_time() - cpu))
        dist.send(torch.tensor([-1, 0], dtype=torch.int64), dst=0)
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=129)
    parser.add_argument("--value-bytes", type=int, default=737_555)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    blocks, size, chunks = args.blocks, args.value_bytes, (1, 16)
    ctx = mp.get_context("spawn")
    rows: dict[tuple[str, int], list[tuple[float, float]]] = {}

    endpoint_q, done = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_zmq_prefill, args=(endpoint_q, blocks, size, done))
    server.start()
    endpoint = endpoint_q.get(timeout=60)
    os.sched_setaffinity(0, {1})  # this process is the zmq decode side
    for chunk in chunks:
        _zmq_decode(endpoint, blocks, size, chunk)  # warm-up
        rows[("zmq", chunk)] = [_zmq_decode(endpoint, blocks, size, chunk)
                                for _ in range(args.repeats)]  # fmt: skip
    done.set()
    server.join(30)

    plan = [c for c in chunks for _ in range(args.repeats + 1)]  # the first of each: warm-up
    out, port = ctx.Queue(), free_port()
    workers = [ctx.Process(target=_gloo_worker, args=(r, port, blocks, size, plan, out))
               for r in (0, 1)]  # fmt: skip
    for w in workers:
        w.start()
    results = out.get(timeout=300)
    for w in workers:
        w.join(30)
    for chunk in chunks:
        runs = [(wall, cpu) for c, wall, cpu in results if c == chunk][1:]
        rows[("gloo", chunk)] = runs

    rows |= _redis_rows(blocks, size, chunks, args.repeats)
    mib = blocks * size / 2**20
    print(f"{blocks} blocks of {size:,} bytes ({mib:.1f} MiB), median of {args.repeats} pulls")
    print("transport  blocks/trip  pull ms  MiB/s   ms a block  decode CPU ms a block")
    for (name, chunk), runs in rows.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"{name:<10} {chunk:>11} {1000 * wall:8.1f} {mib / wall:6.0f}"
              f"  {1000 * wall / blocks:10.3f}  {1000 * cpu / blocks:10.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
