"""The engine's requests by id: the live ones, and the finished outputs waiting for their caller.

`LiveRequests` holds the sequence of each queued or running request, and the sample group
(runner/engine/requests/sample_groups.py) of each request of several samples still running.

`OutputRouter` says whose finished output is whose: the engine's `step` callers, and the
`generate` calls and streams that run the engine for requests of their own. A `generate` or a
stream reserves its requests' ids: their outputs wait here for the `step_for` it calls, even
when another caller's step finished them, and never come back from `step`. Any other output
finished by a `step_for` waits for the next `step`. An id is taken while it is live, reserved
or has an output waiting (runner/engine/requests/intake.py checks both).
"""

from __future__ import annotations

from runner.engine.requests.outputs import RequestOutput
from runner.engine.requests.sample_groups import SampleGroup, sample_request_id
from runner.engine.sequence import Sequence


class LiveRequests:
    """Mutated by `add`, `add_group` and `finish` only; a request id is live from its add to
    the finish of its (last) sequence."""

    def __init__(self) -> None:
        self._seqs: dict[str, Sequence] = {}  # by the sequence's own request id
        self._groups: dict[str, SampleGroup] = {}  # by the request id its samples share

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs or request_id in self._groups

    def is_empty(self) -> bool:
        """No live sequence and no sample group (none is kept once its request has ended)."""
        return not self._seqs and not self._groups

    def add_group(self, request_id: str, n: int) -> None:
        self._groups[request_id] = SampleGroup(request_id, n)

    def add(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq

    def samples_of(self, request_id: str) -> list[Sequence]:
        """The live sequences of a request: its one, or those of its samples still running."""
        group = self._groups.get(request_id)
        if group is None:
            return [self._seqs[request_id]] if request_id in self._seqs else []
        ids = (sample_request_id(request_id, j) for j in range(group.n))
        return [self._seqs[rid] for rid in ids if rid in self._seqs]

    def finish(self, seq: Sequence, output: RequestOutput) -> RequestOutput | None:
        """Forget a finished sequence; returns its request's output, which for a sample of
        several is there only once the last one has finished."""
        del self._seqs[seq.request_id]
        if seq.group is None:
            return output
        merged = self._groups[seq.group].add(seq.sample_index, output)
        if merged is not None:
            del self._groups[seq.group]
        return merged


class OutputRouter:
    """Outputs not yet handed back, and the ids reserved by running `generate`s and streams."""

    def __init__(self) -> None:
        self._waiting: list[RequestOutput] = []
        self._reserved: set[str] = set()

    def for_step(self) -> list[RequestOutput]:
        """What `step` hands back: the waiting outputs but reserved ones, which go on
        waiting."""
        outputs = self._waiting
        self._waiting = [o for o in outputs if o.request_id in self._reserved]
        return [o for o in outputs if o.request_id not in self._reserved]

    def take(self, request_ids: set[str]) -> list[RequestOutput]:
        """The waiting outputs of `request_ids`, no longer waiting."""
        mine = [o for o in self._waiting if o.request_id in request_ids]
        if mine:
            self._waiting = [o for o in self._waiting if o.request_id not in request_ids]
        return mine

    def keep(self, output: RequestOutput | None) -> None:
        """Hold a finished request's output for the caller it belongs to (None: a sample
        whose siblings still run, nothing to hand back yet)."""
        if output is not None:
            self._waiting.append(output)

    def reserve(self, request_ids: set[str]) -> None:
        self._reserved |= request_ids

    def unreserve(self, request_ids: set[str]) -> None:
        self._reserved -= request_ids

    def holds(self, request_id: str) -> bool:
        """Whether the id is reserved or has an output waiting: not free for a new request."""
        return request_id in self._reserved or any(
            o.request_id == request_id for o in self._waiting
        )

    def waiting_ids(self) -> set[str]:
        return {o.request_id for o in self._waiting}

    def any_for_step(self) -> bool:
        """Whether an output waits for `step` (one not reserved)."""
        return any(o.request_id not in self._reserved for o in self._waiting)
