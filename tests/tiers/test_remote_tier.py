"""The remote tier against a real redis-server: a hypothesis state machine against a dict (what
was put is what is read, absent is None, one MGET per chain), and a second process on the same
server gets the first one's prefix as hits with identical greedy output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvcache import LLM, SamplingParams
from kvcache.tiers import RemoteTier
from tests.redis_server import RedisServer

KEYS = st.sampled_from([f"kvcache:test:{i}" for i in range(6)])
REPO = Path(__file__).resolve().parents[2]


def test_the_remote_tier_is_a_dict(redis_server: RedisServer) -> None:
    class RemoteMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tier = RemoteTier(redis_server.url)
            self.tier._client.flushdb()  # noqa: SLF001 - a fresh database per example
            self.ref: dict[str, bytes] = {}

        @rule(items=st.lists(st.tuples(KEYS, st.binary(max_size=64)), max_size=4))
        def put_many(self, items: list[tuple[str, bytes]]) -> None:
            self.tier.put_many(items)
            self.ref.update(items)

        @rule(key=KEYS)
        def discard(self, key: str) -> None:
            self.tier.discard(key)
            self.ref.pop(key, None)

        @rule(keys=st.lists(KEYS, max_size=6))
        def get_many(self, keys: list[str]) -> None:
            assert self.tier.get_many(keys) == [self.ref.get(k) for k in keys]

        @rule(keys=st.lists(KEYS, max_size=6))
        def has_many(self, keys: list[str]) -> None:
            assert self.tier.has_many(keys) == [k in self.ref for k in keys]

        @invariant()
        def not_backing_off(self) -> None:
            assert not self.tier.backing_off

        def teardown(self) -> None:
            self.tier.close()

    run_state_machine_as_test(
        RemoteMachine, settings=settings(max_examples=30, stateful_step_count=15, deadline=None)
    )


CHILD = """
import json, sys
from kvcache import LLM, SamplingParams
model, url, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model, remote_cache_url=url, cache_key="fleet")
outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
llm.flush_cache_tiers()
print(json.dumps([o.token_ids for o in outs]))
"""


def test_a_second_process_gets_the_first_ones_prefix(
    tiny_llama_dir: Path, redis_server: RedisServer
) -> None:
    system = [3 + (i * 13) % 290 for i in range(64)]
    prompts = [system + [7 + i, 9 + i] for i in range(3)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_llama_dir), redis_server.url, json.dumps(prompts)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    theirs = json.loads(child.stdout.strip().splitlines()[-1])
    llm = LLM(str(tiny_llama_dir), remote_cache_url=redis_server.url, cache_key="fleet")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ours = llm.generate(prompts, params)
    assert [o.token_ids for o in ours] == theirs
    assert ours[0].num_cached_tokens == 64  # the system prompt, from the other process
    assert llm.stats()["cache_tiers"]["tiers"]["remote"]["hit_blocks"] >= 4
