"""What the engine asks of the workers, whichever way they run: one `Worker` in this process
(it is its own executor, at no extra cost) or N tensor-parallel ranks (multiproc.py). Every
call is by values, so the same call can be broadcast to other processes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from runner.engine.executor.worker import StepOutput, StepPlan, Worker
from runner.model.blend import BlendRegion, Placement


class Executor(Protocol):
    @property
    def local(self) -> Worker:
        """The worker in this process (rank 0's): its model and pool, for what reads them in
        place (CUDA graphs, profilers, the overlapped loop's uploads)."""
        ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def shard_nbytes(self) -> list[int]:
        """One block's bytes on each rank, in rank order."""
        ...

    def execute(self, plan: StepPlan) -> StepOutput: ...

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None: ...

    def compute_kv(self, token_ids: list[int], start: int, block_table: list[int]) -> None: ...

    def place_and_blend(self, placement: Placement, region: BlendRegion, ratio: float) -> int: ...

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]: ...

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None: ...

    def rank_weight_bytes(self) -> list[int]:
        """Each rank's weights as held, in bytes (runner/engine/executor/worker.py)."""
        ...

    def shutdown(self) -> None: ...
