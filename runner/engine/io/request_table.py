"""The engine's live requests by id: the sequence of each queued or running one, and the sample
group (runner/engine/io/sample_groups.py) of each request of several samples still running."""

from __future__ import annotations

from runner.engine.io.outputs import RequestOutput
from runner.engine.io.sample_groups import SampleGroup, sample_request_id
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
