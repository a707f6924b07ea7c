"""`kvcache router --kv-events` kept every hash a replica announced, under any medium name
(issue 51, item 12): 5,000,000 announced hashes added 518 MiB, 2,001 invented media were each
kept, and /router/stats grew to 1 MB. A replica's view now holds at most its capacity (2^20
hashes by default, as the routed-prefix index), the least recently announced eighth forgotten
past it, and ignores (and counts) events of a medium other than GPU, CPU and DISK."""

from __future__ import annotations

import json

from runner.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from runner.router.event_index import DEFAULT_CAPACITY, EventIndex


def stored(hashes: list[int], medium: str | None = "GPU") -> EventBatch:
    return EventBatch(ts=1.0, events=[BlockStored(hashes, None, [], 16, None, medium)])


def removed(hashes: list[int], medium: str | None = "GPU") -> EventBatch:
    return EventBatch(ts=1.0, events=[BlockRemoved(hashes, medium)])


def test_a_view_holds_at_most_its_capacity_least_recent_forgotten_first() -> None:
    """Past its capacity a view forgets the least recently announced eighth of it."""
    view = EventIndex(capacity=1_000)
    view.apply(0, stored(list(range(600)), "CPU"))
    view.apply(1, stored(list(range(600)), "GPU"))  # the same blocks in the pool too
    view.apply(2, stored(list(range(600, 5_000))))
    assert 875 <= len(view) <= 1_000 and view.forgotten == 5_000 - len(view)
    assert view.counts() == {"GPU": len(view)}  # the CPU copies went with their blocks
    assert view.match(list(range(5_000 - len(view), 5_000))) == len(view)
    assert view.match([0, 1, 2]) == 0
    oldest = 5_000 - len(view)
    view.apply(3, stored([oldest], "DISK"))  # announced again: now the most recent
    view.apply(4, stored(list(range(7_000, 7_000 + 1_000 - len(view) + 1))))  # one past
    assert len(view) == 875 and view.match([oldest]) == 1 and view.match([oldest + 1]) == 0
    assert view.counts() == {"DISK": 1, "GPU": 875}
    view.apply(5, removed([oldest]))  # gone from the pool, still on disk
    assert view.match([oldest]) == 1 and view.match([oldest], "GPU") == 0
    assert view.match([oldest], "DISK") == 1
    view.apply(6, removed([3]))  # forgotten already: nothing to remove
    assert view.counts() == {"DISK": 1, "GPU": 874} and len(view) == 875


def test_the_default_capacity_bounds_a_replica_announcing_more() -> None:
    view = EventIndex()
    step = 1 << 17
    for seq, start in enumerate(range(0, DEFAULT_CAPACITY + 3 * step, step)):
        view.apply(seq, stored(list(range(start, start + step))))
    assert DEFAULT_CAPACITY == 1 << 20 and len(view) <= DEFAULT_CAPACITY
    assert view.forgotten == DEFAULT_CAPACITY + 3 * step - len(view)
    assert view.counts() == {"GPU": len(view)}
    end = DEFAULT_CAPACITY + 3 * step  # the hashes announced: 0 .. end - 1
    assert view.match(list(range(end - len(view), end))) == len(view)


def test_unknown_media_are_ignored_and_counted() -> None:
    view = EventIndex()
    for seq in range(2_001):
        view.apply(seq, stored([seq, seq + 10_000], f"invented-{seq}"))
    view.apply(2_001, stored([1, 2], None))  # no medium: the pool's, as vLLM's
    view.apply(2_002, removed([1], "invented-0"))
    assert view.counts() == {"GPU": 2} and len(view) == 2
    assert view.ignored == 2_002 and view.match([1, 2]) == 2
    assert view.match([1], "invented-0") == 0
    assert len(json.dumps(view.counts())) < 20  # /router/stats' share of the view
    view.apply(2_003, EventBatch(ts=2.0, events=[AllBlocksCleared()]))
    assert view.counts() == {} and len(view) == 0
