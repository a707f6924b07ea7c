"""What the disaggregated router (pd.py) reads of the workers' answers, as types: the prefill
worker's answer lines and their handover params (runner/disagg/routes.py and publish.py write
them), and a decode worker's pull answer (runner/disagg/pull.py). The router speaks to the
workers over HTTP only, so these are declared here, from the reading side: any field may be
missing from a worker of another version."""

from __future__ import annotations

from typing import TypedDict

from runner.serve.json_types import JSONObject


class KVTransferParams(TypedDict, total=False):
    """A handover: where its blocks are (transport, endpoint, id) and of which prompt; while
    ``open``, the prefill is still filling it."""

    transport: str
    endpoint: str | None
    handover_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    num_blocks: int
    bytes: int
    publish_ms: float
    open: bool


class PrefillLine(TypedDict, total=False):
    """One line of a prefill worker's answer: the handover's params, and once the prefill is
    done its answer (``prefill``); a failed prefill's line is an error body instead."""

    kv_transfer_params: KVTransferParams
    prefill: JSONObject
    error: JSONObject


class PullAnswer(TypedDict, total=False):
    """What a decode worker's pull did."""

    wanted: int
    skipped: int
    blocks: int
    bytes: int
    reason: str | None
    ms: float
