"""The engine's core: one step at a time, schedule, execute, settle. Built from the parts the
engine front (runner/engine/api/engine.py) builds, and owned by it: the scheduler and its
policy, the model runner over the executor (one worker here, or tensor-parallel ranks), the
settler that ends each step's requests, the step clock, and, on CUDA, the overlapped loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import InitVar, dataclass, field

from runner.engine.executor.executor import Executor
from runner.engine.step.guards import interrupts_held
from runner.engine.step.isolation import run_each_alone
from runner.engine.step.metrics import StepClock
from runner.engine.step.model_runner import ModelRunner
from runner.engine.step.overlap import OverlappedLoop, StepDevice
from runner.engine.step.scheduler import Scheduler, SchedulerOutput
from runner.engine.step.settle import StepResult, StepSettler, sample_step


@dataclass(eq=False)
class EngineCore:
    """Schedule, execute, settle: the engine's step, and the K/V operations the host issues
    in its order. Holds no request table: requests enter through the scheduler, and leave
    through the settler."""

    scheduler: Scheduler
    runner: ModelRunner
    executor: Executor
    settler: StepSettler
    clock: StepClock
    eos_ids: Collection[int]
    overlap_device: InitVar[StepDevice | None] = None
    # Asynchronous scheduling (the overlapped loop): None runs the plain loop.
    overlap: OverlappedLoop | None = field(init=False, default=None)

    def __post_init__(self, overlap_device: StepDevice | None) -> None:
        if overlap_device is not None:
            self.overlap = OverlappedLoop(
                self.scheduler,
                self.runner,
                overlap_device,
                self.settler.settle,
                self.run,
                self.settler.fail_unfinished,
            )

    def step(self) -> None:
        """One engine step: schedule, run the model and sample, then update the requests and
        the cache. The bookkeeping runs with Ctrl-C held (runner/engine/step/guards.py): an
        interrupt lands before the step's requests are scheduled, during the model's forward
        pass (which nothing has counted on yet), or once every request that finished in the
        step has its output with the router, never between."""
        if self.overlap is not None:  # the same, with the next step queued before this settles
            self.overlap.step()
            return
        t_start = time.perf_counter()
        with interrupts_held():
            out = self.scheduler.schedule()
        result = StepResult.nothing() if out.is_empty else self.run(out)
        with interrupts_held():
            try:
                self.settler.settle(out, result, t_start, self.scheduler.step_count)
            except Exception as err:  # noqa: BLE001 - as a failed forward pass: the step's end
                self.settler.fail_unfinished(out, err)

    def run(self, out: SchedulerOutput) -> StepResult:
        """The forward pass over the step's batch and the sampler over its rows. When either
        raises, each request runs again alone (runner/engine/step/isolation.py), so that only
        a request that fails alone too fails."""
        try:
            self.clock.start()
            logits = self.runner.run(out.scheduled)
            return sample_step(logits, out.scheduled, self.eos_ids, self.clock.stop())
        except Exception as err:  # noqa: BLE001 - one request's failure fails it alone
            return run_each_alone(self.runner, out.scheduled, self.eos_ids, err)

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """The scheduler's slot copy, after the device work queued so far (a step in flight
        may still be writing the source block)."""
        self.run_ordered(lambda: self.executor.copy_slots(src_block, dst_block, num_tokens))

    def run_ordered(self, op: Callable[[], None]) -> None:
        """A K/V operation the host issues, after the device work queued so far."""
        if self.overlap is None:
            op()
        else:
            self.overlap.device.run_ordered(op)

    def settle_inflight(self) -> None:
        """Settle the step in flight, if any (an abort reads what it generated)."""
        if self.overlap is not None:
            self.overlap.settle_inflight()

    def shutdown(self) -> None:
        """Stop the executor's other processes (tensor-parallel ranks)."""
        self.executor.shutdown()
