"""The disaggregation bench's inter-token gaps: counted from the time every decode has its first
token (the decodes' own start is not what a long prompt does to running streams), over every
decode stream, never the long prompts'; outputs compared on the requests two systems both ran."""

from __future__ import annotations

import pytest

from bench.pd_interference import decode_gaps_ms, first_long_arrival_s, same_outputs


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


def test_outputs_are_compared_on_the_requests_both_ran() -> None:
    reference = {"decode-0": "a", "decode-1": "b", "long-0": "c"}
    assert same_outputs(reference, reference)
    assert same_outputs({"decode-0": "a", "decode-1": "b"}, reference)  # the decodes alone
    assert not same_outputs({"decode-0": "a", "decode-1": "x"}, reference)
    assert not same_outputs({"other": "a"}, reference)  # nothing in common: not "same"


def test_gaps_are_counted_from_the_first_long_prompts_arrival() -> None:
    results = [
        {"kind": "decode", "times": [0.0, 0.1, 0.3, 0.4, 0.6]},
        {"kind": "decode", "times": [0.0, 0.2, 0.5]},
        {"kind": "long", "times": [0.5, 5.0]},
    ]
    # From 0.3 on: the first decode's 0.3-0.4 and 0.4-0.6, the second's gaps all start before.
    assert decode_gaps_ms(results, since=0.3) == pytest.approx([100.0, 200.0])
    rows = [
        {"kind": "decode"},
        {"kind": "long", "arrival_s": 4.0},
        {"kind": "long", "arrival_s": 1.5},
    ]
    assert first_long_arrival_s(rows) == 1.5
    assert first_long_arrival_s([{"kind": "decode"}]) == 0.0
