"""The shapes of the prefill/decode interference bench (bench/pd_interference.py): a line of its
workload, what one streamed request saw, and one system's figures (its --json row)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class WorkloadRow(TypedDict):
    """A line of data/pd_interference.jsonl."""

    id: str
    prompt: str
    max_tokens: int
    kind: NotRequired[str]  # "decode" (the default) or "long"
    arrival_s: NotRequired[float]  # from the run's start
    ignore_eos: NotRequired[bool]


class Stream(TypedDict):
    """One request as the client saw it: when it was sent and each token came (perf_counter
    seconds), and its text."""

    id: str
    kind: str
    sent: float
    times: list[float]
    text: str


class StreamTimes(TypedDict):
    """A stream's times in seconds from the first request's send (for scripts/pd_streams.py)."""

    kind: str
    sent_s: float
    token_s: list[float]


class SystemResult(TypedDict):
    """One system's figures (ms where named so), its outputs by request id and its streams;
    with a router, what its handovers moved and took, and both workers' recorded schedules."""

    system: str
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    long_ttft_ms: list[float]
    throughput_tok_s: float
    wall_s: float
    outputs: dict[str, str]
    streams: dict[str, StreamTimes]
    handover_bytes: NotRequired[int]
    handover_blocks: NotRequired[int]
    handover_ms: NotRequired[float]
    pull_ms: NotRequired[float]
    publish_ms: NotRequired[float]
    pd_metrics: NotRequired[dict[str, object]]  # what `kvcache report` reads
    same_output: NotRequired[bool]  # against the first system's
