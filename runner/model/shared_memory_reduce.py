"""An all-reduce through shared memory, for tensor-parallel ranks on one machine's CPU.

gloo's all-reduce between two processes of this machine takes about 1.5 ms for a decode step's
rows, and a step needs two a layer; here each rank copies its rows into a slot of one shared
segment, raises its sequence number, waits until every rank has raised its own, and sums the
slots in rank order (the same bits on every rank, whatever the batch). Each rank has two slots,
used by turns: a rank can only write the slot of step n + 2 once every rank has announced step
n + 1, which each does after it has read step n's slots, so no slot is overwritten while read.

Waiting spins on the sequence numbers (the ranks run in lockstep: the wait is a step's
imbalance, microseconds), yielding the core between reads, and gives up after `timeout_s`
with an error naming the ranks that did not arrive (one that died) instead of spinning forever.
Rows larger than a slot go through the process group instead.
"""

from __future__ import annotations

import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

SLOT_BYTES = 8 << 20  # a slot holds up to 8 MiB of rows: a prompt chunk of 512 tokens x 4096
_HEADER = 64  # bytes before the slots: each rank's sequence number, one cache line apart


class SharedMemoryReduce:
    """One rank's handle on the segment `name` (rank 0 creates it with `create`)."""

    def __init__(
        self,
        name: str,
        rank: int,
        size: int,
        timeout_s: float = 120.0,
        create: bool = False,
        untrack: bool = False,
    ) -> None:
        """`untrack`: an attaching process with a resource tracker of its own (torchrun's ranks)
        takes the segment off it, so that its exit does not remove what rank 0 created."""
        nbytes = self.segment_bytes(size)
        self.memory = shared_memory.SharedMemory(name=name, create=create, size=nbytes)
        if untrack:
            # Its registered name (with the platform's leading "/"): the public one lacks it.
            resource_tracker.unregister(getattr(self.memory, "_name"), "shared_memory")  # noqa: B009
        self.owner = create
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s
        buffer = self.memory.buf
        self.sequences = np.ndarray((size, _HEADER // 8), dtype=np.int64, buffer=buffer)
        if create:
            self.sequences[:] = 0
        self.slots = np.ndarray(
            (2, size, SLOT_BYTES), dtype=np.uint8, buffer=buffer, offset=size * _HEADER
        )
        self.sequence = 0

    @staticmethod
    def segment_bytes(size: int) -> int:
        return size * _HEADER + 2 * size * SLOT_BYTES

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (contiguous, on the CPU, `fits`), in rank order."""
        parts = self._exchange(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return total

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (the same shape on each), on rank 0; None elsewhere."""
        parts = self._exchange(x)
        return [p.clone() for p in parts] if self.rank == 0 else None

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Write `x` to this rank's slot of this turn, announce it, wait for every rank's, and
        return views of all of them (valid until this rank's next exchange but one)."""
        self.sequence += 1
        turn = self.sequence % 2
        raw = x.contiguous().view(-1).view(torch.uint8).numpy()
        nbytes = raw.nbytes
        self.slots[turn, self.rank, :nbytes] = raw
        self.sequences[self.rank, 0] = self.sequence  # after the rows: x86 keeps stores in order
        self._wait_for(self.sequence)
        return [
            torch.from_numpy(self.slots[turn, r, :nbytes]).view(x.dtype).view(x.shape)
            for r in range(self.size)
        ]

    def _wait_for(self, sequence: int) -> None:
        column = self.sequences[:, 0]
        if bool((column >= sequence).all()):
            return
        deadline = time.monotonic() + self.timeout_s
        while not bool((column >= sequence).all()):
            if time.monotonic() > deadline:
                late = [r for r in range(self.size) if column[r] < sequence]
                raise RuntimeError(
                    f"tensor-parallel ranks {late} did not reach step {sequence} of the shared-"
                    f"memory all-reduce within {self.timeout_s:.0f} s (a rank died or hangs)"
                )
            time.sleep(0)  # yield the core to the rank being waited for

    def close(self) -> None:
        """Unmap the segment; its creator also removes it."""
        del self.sequences, self.slots
        self.memory.close()
        if self.owner:
            self.memory.unlink()
