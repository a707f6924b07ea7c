"""The engine interface (runner/engine/api/interface.py) as `LLM` implements it: the cached prefix
of a prompt and its block values, block listeners told of commits and removals, handed-over
blocks installed into another engine's pool, and the reports (queue depth, pool, cache
counters) the other packages read instead of the engine's parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from kvcache.radix_tree import Node
from runner.disagg.blocks import check_values, prompt_chain
from runner.engine.api.interface import EngineInterface

PROMPT = "A prompt long enough for several blocks of four tokens each, and then some more."
ONE = SamplingParams(max_tokens=1, temperature=0)


class Recorder:
    """A block listener that keeps what it was told."""

    def __init__(self) -> None:
        self.stored: list[Node] = []
        self.removed: list[Node] = []

    def blocks_stored(self, nodes: list[Node]) -> None:
        self.stored += nodes

    def blocks_removed(self, nodes: list[Node]) -> None:
        self.removed += nodes


def _run(llm: LLM, prompt: str, salt: str | None = None) -> list[int]:
    seq = llm.add_request(prompt, ONE, cache_salt=salt)
    while llm.has_unfinished():
        llm.step()
    return list(seq.prompt_token_ids)


@pytest.fixture
def llm(tiny_llama_tok_dir: Path) -> LLM:
    return LLM(str(tiny_llama_tok_dir), block_size=4, num_kv_blocks=64)


def test_an_llm_is_an_engine_interface(llm: LLM) -> None:
    engine: EngineInterface = llm  # mypy checks the whole Protocol here; isinstance its names
    assert isinstance(engine, EngineInterface)


def test_the_cached_prefix_stops_before_the_last_tokens_block(llm: LLM) -> None:
    tokens = llm.tokenizer.encode(PROMPT)
    assert llm.cached_prefix(tokens, None).blocks == 0
    tokens = _run(llm, PROMPT)
    usable = (len(tokens) - 1) // 4
    cached = llm.cached_prefix(tokens, None)
    assert cached.blocks == usable and cached.tokens == usable * 4
    assert llm.cached_prefix(tokens, "another salt").blocks == 0  # another namespace
    assert llm.cached_prefix(tokens[:9], None).blocks == 2  # 9 tokens: the third holds the last


def test_cached_block_values_pass_the_decode_sides_checks(
    llm: LLM, tiny_llama_tok_dir: Path
) -> None:
    tokens = _run(llm, PROMPT, salt="s")
    values = llm.cached_block_values(tokens, "s")
    other = LLM(str(tiny_llama_tok_dir), block_size=4, num_kv_blocks=64, host_cache_bytes=1 << 22)
    chain = prompt_chain(other, tokens, "s")
    assert len(values) == len(chain.hashes) > 3
    checked = check_values(other, chain, 0, values)
    assert checked.passed == len(values) and checked.reason is None
    assert check_values(other, prompt_chain(other, tokens, None), 0, values).passed == 0
    # Installed into the other engine's pool: its cached prefix is then the whole chain.
    installed = other.install_blocks(tokens, "s", 0, checked.kvs)
    assert installed.held == installed.loaded == len(values)
    assert other.cached_prefix(tokens, "s").blocks == len(values)
    assert other.cached_block_values(tokens, "s") == values
    assert other.install_blocks(tokens, "s", 0, checked.kvs).loaded == 0  # held already
    other.check_integrity()
    (want,) = llm.generate([tokens], SamplingParams(max_tokens=6, temperature=0), cache_salt="s")
    (got,) = other.generate([tokens], SamplingParams(max_tokens=6, temperature=0), cache_salt="s")
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens == len(values) * 4


def test_listeners_hear_commits_and_removals_until_removed(llm: LLM) -> None:
    first, second = Recorder(), Recorder()
    llm.add_block_listener(first)
    llm.add_block_listener(second)  # beside the first, not in its place
    tokens = _run(llm, PROMPT)
    usable = llm.cached_prefix(tokens, None).blocks
    assert [n.key for n in first.stored] == [n.key for n in second.stored]
    assert len(first.stored) >= usable
    # The values of the blocks a listener heard of are the prompt's cached block values.
    assert llm.block_values(first.stored[:usable]) == llm.cached_block_values(tokens, None)
    llm.remove_block_listener(second)
    assert llm.reset_prefix_cache()
    assert {n.key for n in first.removed} >= {n.key for n in first.stored}
    assert second.removed == []
    with pytest.raises(ValueError):
        llm.remove_block_listener(second)


def test_reports_read_the_engine_without_its_parts(llm: LLM) -> None:
    pool = llm.kv_pool()
    assert (pool.num_blocks, pool.block_size) == (64, 4) and pool.num_slots == 256
    assert pool.nbytes > 0 and pool.dtype_name == "float32"
    for prompt in ("one prompt", "and another one"):
        llm.add_request(prompt, ONE)
    depth = llm.queue_depth()
    assert (depth.running, depth.waiting, depth.preemptions) == (0, 2, 0)
    llm.step()
    assert llm.queue_depth().last_step_tokens > 0
    while llm.has_unfinished():
        llm.step()
    assert llm.kv_event_endpoints() is None  # it publishes no KV events
    stats = llm.cache_stats()
    assert stats.blocks_in_use == 0 and stats.query_tokens > 0
    assert llm.stats()["query_tokens"] == stats.query_tokens


def test_kv_event_endpoints_say_where_the_engine_publishes(tiny_llama_tok_dir: Path) -> None:
    events = {"enable_kv_cache_events": True, "topic": "kv"}
    events |= {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
    llm = LLM(str(tiny_llama_tok_dir), block_size=4, num_kv_blocks=16, kv_events_config=events)
    assert llm.kv_events is not None
    try:
        shown = llm.kv_event_endpoints()
        assert shown is not None and shown == llm.kv_events.endpoints()
        assert shown["topic"] == "kv" and str(shown["replay_endpoint"]).startswith("tcp://")
    finally:
        llm.kv_events.close()
