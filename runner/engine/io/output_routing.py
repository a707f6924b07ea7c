"""Whose finished output is whose: the engine's `step` callers, and the `generate` calls and
streams that run the engine for requests of their own.

A `generate` or a stream reserves its requests' ids: their outputs wait here for the
`step_for` it calls, even when another caller's step finished them, and never come back from
`step`. Any other output finished by a `step_for` waits for the next `step`.
"""

from __future__ import annotations

from runner.engine.io.outputs import RequestOutput


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
