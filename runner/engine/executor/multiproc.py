"""N tensor-parallel workers: rank 0 in the engine's process, ranks 1..N-1 in processes of
their own, joined by torch.distributed process groups (no transport of our own).

Two groups join the ranks: a gloo group on the CPU carries the engine's calls (each call
pickled and broadcast from rank 0, then run by every rank in the same order) and gathers the
tier bytes; the device group (gloo on the CPU, NCCL on CUDA) carries the layers' all-reduces
and the LM head's gather (runner/model/tensor_parallel.py). The groups are built from a store
directly, never as torch.distributed's default group: two engines may live in one process.

Ranks start either here (spawned on this machine, rendezvous at a free loopback port, or at
`distributed_init_method`'s tcp://host:port) or from torch.distributed's environment as torchrun
sets it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): one process a rank, on as many machines
as asked; rank 0 runs the engine, the others `serve_rank` and exit when it shuts down.

A worker that dies, or a collective that fails, ends the engine with an error naming the rank:
every later call raises it. Without that a rank left behind mid-collective would hang the rest.
"""

from __future__ import annotations

import logging
import os
import pickle
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runner.engine.config import EngineConfig
from runner.engine.executor.build import ModelShare, load_share, make_worker, pool_blocks
from runner.engine.executor.worker import StepOutput, StepPlan, Worker
from runner.kv_pool.store import KVStore
from runner.model.blend import BlendRegion, Placement
from runner.model.loader import read_config, resolve_model_dir
from runner.model.shared_memory_reduce import SharedMemoryReduce
from runner.model.tensor_parallel import Collectives, TensorParallel, head_share

log = logging.getLogger(__name__)

# How long a rank waits for the others in one collective before it gives up: the backstop
# behind the dead-worker checks (a process that exits closes its sockets, which ends the wait
# at once); start-up, the longest wait (every rank loading its weights), is covered too.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
SHUTDOWN = "shutdown"

T = TypeVar("T")


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: the store's host and port, this rank, and how many there are."""

    host: str
    port: int
    rank: int
    size: int

    @staticmethod
    def from_environment(size: int) -> Rendezvous | None:
        """torchrun's variables, when they are set; their WORLD_SIZE must be `size`."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"tensor_parallel_size={size}, but the environment's WORLD_SIZE is {world}"
            )
        return Rendezvous(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", "29500")),
            int(os.environ["RANK"]),
            world,
        )


def open_store(meet: Rendezvous) -> dist.TCPStore:
    """The ranks' meeting point: rank 0 hosts it (at a free port when `meet.port` is 0)."""
    return dist.TCPStore(
        meet.host,
        meet.port,
        meet.size,
        is_master=meet.rank == 0,
        timeout=COLLECTIVE_TIMEOUT,
        wait_for_workers=False,
    )


def parse_init_method(method: str) -> tuple[str, int]:
    """(host, port) of a tcp://host:port init method."""
    if not method.startswith("tcp://") or ":" not in method[6:]:
        raise ValueError(f"distributed_init_method {method!r} is not tcp://host:port")
    host, _, port = method[6:].rpartition(":")
    if not port.isdigit():
        raise ValueError(f"distributed_init_method {method!r}: the port is not a number")
    return host, int(port)


class Groups:
    """The two process groups of one rank (see the module's docstring)."""

    def __init__(self, store: dist.Store, meet: Rendezvous, device: torch.device) -> None:
        self.store = store  # kept: the groups' connections were made through it
        self.rank, self.size = meet.rank, meet.size
        control = dist.PrefixStore("control", store)
        # torch's stubs leave the backends' collectives out; they are there at run time.
        self.control = cast(
            Collectives, dist.ProcessGroupGloo(control, meet.rank, meet.size, COLLECTIVE_TIMEOUT)
        )
        self.device: Collectives
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            self.device = cast(
                Collectives,
                dist.ProcessGroupNCCL(
                    dist.PrefixStore("device", store), meet.rank, meet.size, options
                ),
            )
        else:
            self.device = cast(
                Collectives,
                dist.ProcessGroupGloo(
                    dist.PrefixStore("device", store), meet.rank, meet.size, COLLECTIVE_TIMEOUT
                ),
            )

    def broadcast_object(self, value: object = None) -> object:
        """Rank 0's `value` on every rank (pickled: the engine's calls are values)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.broadcast(data, 0).wait()
        return value if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Every rank's `payload` on rank 0, in rank order; None on the others."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.control.allgather([sizes], [size]).wait()
        widest = max(1, max(int(s.item()) for s in sizes))
        buf = torch.zeros(widest, dtype=torch.uint8)
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs: list[list[torch.Tensor]] = []
        if self.rank == 0:
            outputs.append([torch.empty_like(buf) for _ in range(self.size)])
        self.control.gather(outputs, [buf], options).wait()
        if self.rank != 0:
            return None
        return [
            out[: int(s.item())].numpy().tobytes() for out, s in zip(outputs[0], sizes, strict=True)
        ]


class WorkersFailed(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot go on."""


class MultiprocExecutor:
    """Rank 0's side: each call broadcast to the other ranks, then run by its own worker."""

    def __init__(
        self,
        local: Worker,
        groups: Groups,
        processes: list[BaseProcess],
        shard_nbytes: list[int],
    ) -> None:
        self._local = local
        self.groups = groups
        self.processes = processes  # those this process spawned (none under torchrun)
        self.shard_nbytes = shard_nbytes  # one block's bytes on each rank
        self.failure: str | None = None
        tp = local.model.tp
        shared = tp.local if tp is not None else None  # the shared-memory segment it created
        self._stop = weakref.finalize(self, stop_ranks, groups, processes, shared)

    @property
    def local(self) -> Worker:
        return self._local

    @property
    def tensor_parallel_size(self) -> int:
        return self.groups.size

    def execute(self, plan: StepPlan) -> StepOutput:
        return self._call("execute", self._local.execute, plan)

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        self._call("copy_slots", self._local.copy_slots, src_block, dst_block, num_tokens)

    def compute_kv(self, token_ids: list[int], start: int, block_table: list[int]) -> None:
        self._call("compute_kv", self._local.compute_kv, token_ids, start, block_table)

    def place_and_blend(self, placement: Placement, region: BlendRegion, ratio: float) -> int:
        return self._call("place_and_blend", self._local.place_and_blend, placement, region, ratio)

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block's bytes: every rank's shard of it, in rank order."""

        def read(ids: Sequence[int]) -> list[bytes]:
            mine = self._local.read_blocks(ids)
            shards = self.groups.gather_bytes(b"".join(mine))
            assert shards is not None
            return [
                b"".join(
                    rank_bytes[i * n : (i + 1) * n]
                    for rank_bytes, n in zip(shards, self.shard_nbytes, strict=True)
                )
                for i in range(len(ids))
            ]

        return self._call("read_blocks", read, list(block_ids))

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None:
        """`read_blocks`' bytes back: each rank takes its shard of each payload."""

        def write(ids: list[int], whole: list[bytes | memoryview]) -> None:
            self._local.write_blocks(ids, [shard_of(p, 0, self.shard_nbytes) for p in whole])

        self._call("write_blocks", write, list(block_ids), [bytes(p) for p in payloads])

    def rank_weight_bytes(self) -> list[int]:
        def gather(_: None) -> list[int]:
            sizes = self.groups.gather_bytes(self._local.weight_bytes().to_bytes(8, "little"))
            assert sizes is not None
            return [int.from_bytes(b, "little") for b in sizes]

        return self._call("rank_weight_bytes", gather, None)

    def shutdown(self) -> None:
        """Stop the other ranks (and join the processes this one spawned)."""
        self._stop()

    def _call(self, name: str, run: Callable[..., T], *args: object) -> T:
        if self.failure is not None:
            raise WorkersFailed(self.failure)
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                self._fail(f"tensor-parallel rank {rank} exited (code {process.exitcode})")
        try:
            self.groups.broadcast_object((name, args))
            return run(*args)
        except Exception as err:
            dead = [
                f"rank {r} exited (code {p.exitcode})"
                for r, p in enumerate(self.processes, start=1)
                if not p.is_alive()
            ]
            why = "; ".join(dead) if dead else f"{type(err).__name__}: {err}"
            self._fail(f"tensor-parallel {name} failed: {why}")
            raise AssertionError("unreachable") from err

    def _fail(self, why: str) -> None:
        """Ranks out of step cannot be brought back: stop them all, and refuse what follows."""
        self.failure = f"{why}; the engine's workers were stopped"
        self._stop()
        raise WorkersFailed(self.failure)


def stop_ranks(
    groups: Groups, processes: list[BaseProcess], shared: SharedMemoryReduce | None = None
) -> None:
    """Tell the other ranks to stop (where they still listen), then join what this rank spawned,
    killing what does not end in time, and remove the shared-memory segment."""
    if all(p.is_alive() for p in processes):
        try:
            groups.broadcast_object((SHUTDOWN, ()))
        except Exception:  # noqa: BLE001 - a rank already gone: the joins below end it
            log.debug("the stop message did not reach every rank", exc_info=True)
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
    if shared is not None:
        shared.close()


def shard_of(payload: bytes | memoryview, rank: int, shard_nbytes: list[int]) -> bytes:
    """Rank `rank`'s part of one block's bytes (`read_blocks` joins the ranks' in order)."""
    if len(payload) != sum(shard_nbytes):
        raise ValueError(f"a block of {len(payload)} bytes; this pool's are {sum(shard_nbytes)}")
    start = sum(shard_nbytes[:rank])
    return bytes(payload[start : start + shard_nbytes[rank]])


def serve_rank(worker: Worker, groups: Groups, shard_nbytes: list[int]) -> None:
    """A rank other than 0: run rank 0's calls, in its order, until it says stop. An error here
    ends the process: the ranks cannot agree on what ran, and rank 0 sees the exit."""
    while True:
        message = groups.broadcast_object()
        assert isinstance(message, tuple)
        name, args = message
        if name == SHUTDOWN:
            return
        if name == "rank_weight_bytes":
            groups.gather_bytes(worker.weight_bytes().to_bytes(8, "little"))
        elif name == "read_blocks":
            groups.gather_bytes(b"".join(worker.read_blocks(*args)))
        elif name == "write_blocks":
            block_ids, payloads = args
            worker.write_blocks(
                block_ids, [shard_of(p, groups.rank, shard_nbytes) for p in payloads]
            )
        else:
            getattr(worker, name)(*args)


class Launched(NamedTuple):
    executor: MultiprocExecutor
    share: ModelShare  # rank 0's


def start_tensor_parallel(config: EngineConfig, device: torch.device) -> Launched:
    """Rank 0 of `config.tensor_parallel_size` ranks: the others spawned here, or already
    started by torchrun (a process whose RANK is not 0 serves that rank, then exits)."""
    size = config.tensor_parallel_size
    check_heads(config, size)  # before any process starts
    meet = Rendezvous.from_environment(size)
    processes: list[BaseProcess] = []
    spawn = meet is None
    if meet is None:
        host, port = ("127.0.0.1", 0)
        if config.distributed_init_method is not None:
            host, port = parse_init_method(config.distributed_init_method)
        meet = Rendezvous(host, port, 0, size)
    elif meet.rank != 0:
        rank_main(config, meet, threads=0)
        raise SystemExit(0)
    store = open_store(meet)
    try:
        if spawn:
            threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else 0
            processes = spawn_ranks(config, meet.host, store.port, size, threads)
        groups = Groups(store, meet, rank_device(config, 0))
        groups.broadcast_object(config)  # every rank builds what rank 0 was asked for
        local = None
        if device.type == "cpu" and one_machine(spawn):  # sums through shared memory
            name = f"kvcache-tp-{os.getpid()}-{store.port}"
            local = SharedMemoryReduce(name, 0, size, create=True)
        groups.broadcast_object(local.memory.name if local is not None else None)
        tp = TensorParallel(0, size, groups.device, config.deterministic, local)
        share = load_share(config, rank_device(config, 0), tp)
        num_blocks = pool_blocks(config, share, device)
        groups.broadcast_object(num_blocks)
        worker = make_worker(config, share, rank_device(config, 0), num_blocks)
        kv = worker.kv
        mine = KVStore.bytes_per_block(
            kv.num_layers, kv.block_size, kv.num_kv_heads, kv.head_dim, kv.dtype
        )
        # Every rank's block size, for the tiers' bytes: gathered, then sent to all.
        sizes = groups.gather_bytes(mine.to_bytes(8, "little"))
        assert sizes is not None
        shard_nbytes = [int.from_bytes(b, "little") for b in sizes]
        groups.broadcast_object(shard_nbytes)
    except BaseException:
        for process in processes:
            process.kill()
            process.join(timeout=10)
        raise
    return Launched(MultiprocExecutor(worker, groups, processes, shard_nbytes), share)


def serve_rank_from_environment(config: EngineConfig) -> bool:
    """Under torchrun, in a process whose RANK is not 0: serve that rank until rank 0's engine
    stops, then return True (the process has nothing else to do: a command line exits before
    it opens any file). False everywhere else."""
    if config.tensor_parallel_size == 1:
        return False
    meet = Rendezvous.from_environment(config.tensor_parallel_size)
    if meet is None or meet.rank == 0:
        return False
    rank_main(config, meet, threads=0)
    return True


def one_machine(spawned: bool) -> bool:
    """Whether every rank runs on this machine: spawned here, or torchrun's one node."""
    if spawned:
        return True
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


def check_heads(config: EngineConfig, size: int) -> None:
    """ValueError where the model's heads cannot be split over `size` ranks."""
    hf = read_config(resolve_model_dir(config.model))
    heads = int(hf.num_attention_heads)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    for rank in range(size):
        head_share(heads, kv_heads, size, rank)


def spawn_ranks(
    config: EngineConfig, host: str, port: int, size: int, threads: int
) -> list[BaseProcess]:
    """Ranks 1..size-1 as processes of this machine."""
    context = mp.get_context("spawn")
    processes: list[BaseProcess] = []
    for rank in range(1, size):
        meet = Rendezvous(host, port, rank, size)
        process = context.Process(
            target=rank_main,
            args=(config, meet, threads, True),
            name=f"kvcache-tp{rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)
    return processes


def rank_main(config: EngineConfig, meet: Rendezvous, threads: int, spawned: bool = False) -> None:
    """A rank's process (spawned by rank 0, or started by torchrun): build its share of the
    model and pool, then serve."""
    if threads > 0:
        torch.set_num_threads(threads)
    device = rank_device(config, meet.rank)
    groups = Groups(open_store(meet), meet, device)
    # Rank 0's options, whatever this process was started with: under torchrun each rank parses
    # its own command line, and only rank 0's model, context and pool count.
    asked = groups.broadcast_object()
    assert isinstance(asked, EngineConfig)
    config = asked
    name = groups.broadcast_object()
    local = None
    if isinstance(name, str):
        # A spawned rank shares rank 0's resource tracker, which removes the segment with
        # rank 0; under torchrun its own tracker must leave the segment alone.
        local = SharedMemoryReduce(name, meet.rank, meet.size, untrack=not spawned)
    tp = TensorParallel(meet.rank, meet.size, groups.device, config.deterministic, local)
    share = load_share(config, device, tp)
    num_blocks = groups.broadcast_object()
    assert isinstance(num_blocks, int)
    worker = make_worker(config, share, device, num_blocks)
    kv = worker.kv
    mine = KVStore.bytes_per_block(
        kv.num_layers, kv.block_size, kv.num_kv_heads, kv.head_dim, kv.dtype
    )
    groups.gather_bytes(mine.to_bytes(8, "little"))
    shard_nbytes = groups.broadcast_object()
    assert isinstance(shard_nbytes, list)
    try:
        serve_rank(worker, groups, shard_nbytes)
    finally:
        if local is not None:
            local.close()


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: cuda:r (of this machine's GPUs) on CUDA, else the CPU."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
