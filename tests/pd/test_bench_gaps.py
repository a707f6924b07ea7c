"""The disaggregation bench's inter-token gaps: counted from the time every decode has its first
token (the decodes' own start is not what a long prompt does to running streams), over every
decode stream, never the long prompts'."""

from __future__ import annotations

import pytest

from runner.disagg.bench import decode_gaps_ms


def test_gaps_start_once_every_decode_streams() -> None:
    results = [
        # the first decode streams alone for a while: its first two gaps are the start
        {"kind": "decode", "times": [0.0, 0.1, 0.3, 0.4, 0.6]},
        {"kind": "decode", "times": [0.3, 0.4, 0.6]},  # joins at 0.3
        {"kind": "long", "times": [0.5, 5.0]},  # a long prompt's own gaps are not ITL
    ]
    assert decode_gaps_ms(results) == pytest.approx([100.0, 200.0, 100.0, 200.0])


def test_no_decode_no_gap() -> None:
    assert decode_gaps_ms([{"kind": "long", "times": [1.0, 2.0]}]) == []
    assert decode_gaps_ms([{"kind": "decode", "times": []}]) == []
