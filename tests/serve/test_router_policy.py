"""The cache-aware policy on synthetic replicas (no servers): requests are token lists hashed
as the engine hashes them, routed one after another the way the router does it (the chosen
replica's index records the prompt, its work is added, and taken back as the request
prefills and ends). What it must do at its defaults: a prefix every conversation shares
spreads over the replicas, a conversation's next turn stays on its replica, an overloaded
replica is avoided, and a long shared document stays where it is cached unless that replica
is overloaded."""

from __future__ import annotations

import pytest

from kvcache import block_hashes, namespace_root
from runner.router.load import FirstToken, Work
from runner.router.policy import CacheAware, Route, make_policy
from runner.router.replicas import Replica
from runner.router.shared_prefix import SharedPrefixes

BLOCK = 16
ROOT = namespace_root("synthetic-model", None)
SYSTEM = list(range(1000, 1000 + 29 * BLOCK))  # a 29-block system prompt, as in the bench


def replicas(n: int) -> list[Replica]:
    return [Replica(f"http://r{i}", healthy=True, info={"block_size": BLOCK}) for i in range(n)]


def own(conversation: int, blocks: int) -> list[int]:
    """Tokens no other conversation has."""
    start = 100_000 * (conversation + 1)
    return list(range(start, start + blocks * BLOCK))


def route(policy: CacheAware, reps: list[Replica], tokens: list[int]) -> tuple[Route, Work]:
    """One request routed and started (its work in flight), as Router.forward does it."""
    hashes = block_hashes(tokens, BLOCK, ROOT)
    chosen = policy.choose(reps, lambda r: hashes)
    chosen.replica.index.insert(hashes)
    work = Work(chosen.replica, chosen.prefill_blocks, answer_blocks=1)
    work.start()
    return chosen, work


def test_a_shared_system_prompt_spreads_new_conversations() -> None:
    # All at once, nothing answered yet: each replica takes its share.
    reps, policy = replicas(4), CacheAware()
    for c in range(8):
        route(policy, reps, SYSTEM + own(c, 19))
    assert [r.sent for r in reps] == [2, 2, 2, 2]


def test_conversations_arriving_one_by_one_spread_evenly() -> None:
    # Each has prefilled and is decoding when the next arrives: the requests sent lately and
    # the work in flight outweigh the shared prompt, known to be shared by more and more
    # conversations.
    for n in (2, 4):
        reps, policy = replicas(n), CacheAware()
        for c in range(16):
            _, work = route(policy, reps, SYSTEM + own(c, 19))
            work.prefilled()
        assert [r.sent for r in reps] == [16 // n] * n, n


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("half_life", [120.0, 30.0, 0.0])
def test_conversations_on_an_idle_cluster_spread_by_what_was_sent_lately(
    half_life: float,
) -> None:
    # One every 10 s, each done before the next: nothing is ever in flight, so only the
    # requests sent lately keep the warm replica (it holds the system prompt, the cheapest
    # for every newcomer) from taking them all; without that memory it takes them all.
    clock = Clock()
    reps = replicas(4)
    policy = CacheAware(recent_half_life_s=half_life, clock=clock)
    for c in range(12):
        _, work = route(policy, reps, SYSTEM + own(c, 19))
        work.finish()
        clock.now += 10.0
    sent = sorted(r.sent for r in reps)
    if half_life >= 120:  # the default: conversations started within minutes count
        assert sent == [3, 3, 3, 3]
    elif half_life:  # forgotten sooner, the first few go where the prompt is
        assert sent[0] >= 2 and sent[-1] <= 4, sent
    else:
        assert sent == [0, 0, 0, 12]


def test_what_was_sent_lately_fades() -> None:
    clock = Clock()
    reps = replicas(2)
    policy = CacheAware(recent_half_life_s=30.0, clock=clock)
    first, work = route(policy, reps, SYSTEM + own(0, 19))
    work.finish()
    clock.now += 30.0 * 20  # twenty half-lives: the first request is forgotten
    chosen, _ = route(policy, reps, SYSTEM + own(1, 19))
    assert chosen.replica is first.replica  # the system prompt is there
    # Its next turn continues it: the work its start stood for, not a new conversation.
    before = policy.recent[chosen.replica.url].value(clock.now)
    route(policy, reps, SYSTEM + own(1, 19) + own(2, 5))
    assert policy.recent[chosen.replica.url].value(clock.now) == before
    with pytest.raises(ValueError, match="recent_half_life_s"):
        CacheAware(recent_half_life_s=-1)


def test_a_conversations_next_turn_stays_on_its_replica() -> None:
    reps, policy = replicas(2), CacheAware()
    history = [SYSTEM + own(c, 19) for c in range(4)]
    homes, works = [], []
    for tokens in history:
        chosen, work = route(policy, reps, tokens)
        homes.append(chosen.replica)
        works.append(work)
    for work in works:
        work.finish()
    # The first conversation's replica has a prompt of 15 blocks waiting: less than the
    # conversation's history is worth there.
    Work(homes[0], 15, 1).start()
    for turn in range(3):
        for c, tokens in enumerate(history):
            history[c] = tokens + own(50 + 10 * c + turn, 9)  # an answer and a follow-up
            chosen, work = route(policy, reps, history[c])
            assert chosen.replica is homes[c], (turn, c)
            assert chosen.reason == "prefix_match"
            assert chosen.prefill_blocks == 9
            work.finish()


def test_an_overloaded_replica_is_avoided() -> None:
    reps, policy = replicas(2), CacheAware()
    tokens = SYSTEM + own(0, 19)
    home, _ = route(policy, reps, tokens)
    for _ in range(8):  # a backlog of prompts waiting on the conversation's replica
        Work(home.replica, 40, 1).start()
    chosen, _ = route(policy, reps, tokens + own(99, 9))
    assert chosen.replica is not home.replica
    assert chosen.reason == "load"


def test_a_long_shared_document_stays_on_its_replica_unless_overloaded() -> None:
    reps, policy = replicas(2), CacheAware()
    document = list(range(5000, 5000 + 200 * BLOCK))
    home, first = route(policy, reps, document + own(0, 2))
    first.prefilled()  # the document is computed there
    other = reps[1] if home.replica is reps[0] else reps[0]
    for q in range(1, 4):  # more questions on it while the first is still in flight
        chosen, _ = route(policy, reps, document + own(q, 2))
        assert chosen.replica is home.replica
    for _ in range(6):  # a backlog far beyond the document's worth
        Work(home.replica, 200, 1).start()
    chosen, _ = route(policy, reps, document + own(9, 2))
    assert chosen.replica is other


def test_the_imbalance_guard_and_the_options() -> None:
    reps = replicas(2)
    policy = CacheAware(balance_abs=2, balance_rel=1.5)
    tokens = SYSTEM + own(0, 19)
    home, work = route(policy, reps, tokens)
    work.prefilled()
    for _ in range(3):
        Work(home.replica, 0, 0).start()  # busy with requests, but no blocks of work
    chosen, _ = route(policy, reps, tokens + own(1, 2))
    assert chosen.reason == "balance" and chosen.replica is not home.replica
    with pytest.raises(ValueError, match="load_weight"):
        make_policy("cache_aware", load_weight=-1)
    with pytest.raises(ValueError, match="threshold"):
        make_policy("cache_aware", threshold=2)
    # A threshold makes short matches count as none: the prompt then goes by load alone.
    strict = CacheAware(threshold=0.9)
    reps = replicas(2)
    route(strict, reps, SYSTEM + own(0, 19))
    chosen, _ = route(strict, reps, SYSTEM + own(1, 19))
    assert chosen.matched_blocks == 0


def test_shared_prefixes_count_conversations_per_block() -> None:
    shared = SharedPrefixes()
    a, b = [1, 2, 3, 4], [1, 2, 7, 8]
    assert shared.observe(a) == [1, 1, 1, 1]
    assert shared.observe(b) == [2, 2, 1, 1]  # blocks 1 and 2 are common, then they branch
    assert shared.observe(a + [5]) == [2, 2, 1, 1, 1]  # a later turn of a: its own blocks
    small = SharedPrefixes(capacity=2)
    small.observe([1, 2, 3])
    assert small.observe([9]) == [1] and len(small._next) == 2


def test_first_token_skips_the_role_chunk_and_reads_split_events() -> None:
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    text = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
    watch = FirstToken()
    assert not watch.feed(role)
    assert not watch.feed(text[:20])
    assert watch.feed(text[20:])
    completion = FirstToken()
    assert completion.feed(b'data: {"choices": [{"text": "a", "index": 0}]}\r\n\r\n')
    assert FirstToken().feed(b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n')
