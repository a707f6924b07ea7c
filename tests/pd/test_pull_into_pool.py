"""A pull copies the checked blocks straight into the decode worker's pool; those the pool
cannot take now (its blocks held by running requests) wait in the host tier, and admission
finds them there: either way the request computes none of them and answers as the colocated
engine does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from kvcache.tiers import storage_key
from runner.disagg.blocks import check_values, prompt_chain
from runner.disagg.pull import Puller
from runner.disagg.roles import RoleOptions, engine_options_for
from tests.pd.test_handover import PROMPT

GREEDY = SamplingParams(max_tokens=8, temperature=0)
HOG = "A running request that holds most of the pool while the pull arrives."


def _decode_llm(model_dir: Path, num_kv_blocks: int) -> LLM:
    options = engine_options_for(RoleOptions(role="decode"), {"num_kv_blocks": num_kv_blocks})
    return LLM(str(model_dir), **options)


def _prompt_values(model_dir: Path) -> tuple[list[int], list[bytes]]:
    """The prompt's token ids and the values a prefill worker would hand over for it."""
    prefill = LLM(str(model_dir))
    seq = prefill.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0))
    while prefill.has_unfinished():
        prefill.step()
    tokens = list(seq.prompt_token_ids)
    return tokens, prefill.cached_block_values(tokens, None)


def _install(llm: LLM, tokens: list[int], values: list[bytes]) -> list[str]:
    """Check the values and install them the way a pull does; their host tier keys."""
    chain = prompt_chain(llm, tokens, None)
    checked = check_values(llm, chain, 0, values)
    assert checked.passed == len(values) and checked.reason is None
    keys = [storage_key(llm.block_spec, h) for h in chain.hashes]
    Puller(llm)._install(chain, None, keys, 0, checked.kvs, values)
    return keys


def _in_pool(llm: LLM, tokens: list[int]) -> int:
    return llm.cached_prefix(tokens, None).blocks


def test_a_pull_puts_every_block_in_the_pool_when_it_has_room(
    tiny_llama_tok_dir: Path, reference_llm: LLM
) -> None:
    tokens, values = _prompt_values(tiny_llama_tok_dir)
    llm = _decode_llm(tiny_llama_tok_dir, 256)
    keys = _install(llm, tokens, values)
    assert len(values) > 4 and _in_pool(llm, tokens) == len(values)
    assert llm.tiers is not None and llm.tiers.host is not None
    assert not any(key in llm.tiers.host for key in keys)  # no second copy in the host tier
    llm.block_manager.check_integrity()
    (want,) = reference_llm.generate([PROMPT], GREEDY)
    (got,) = llm.generate([PROMPT], GREEDY)
    assert got.text == want.text
    assert got.num_cached_tokens == len(values) * llm.config.block_size


def test_blocks_the_pool_cannot_take_wait_in_the_host_tier(
    tiny_llama_tok_dir: Path, reference_llm: LLM
) -> None:
    tokens, values = _prompt_values(tiny_llama_tok_dir)
    llm = _decode_llm(tiny_llama_tok_dir, 12)
    hog = llm.add_request(HOG, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    llm.step()  # its prefill: its blocks are held while it runs
    keys = _install(llm, tokens, values)
    in_pool = _in_pool(llm, tokens)
    assert llm.tiers is not None and llm.tiers.host is not None
    in_host = [key in llm.tiers.host for key in keys]
    assert in_pool < len(values)  # the pool could not take them all
    assert in_host == [False] * in_pool + [True] * (len(values) - in_pool)
    llm.block_manager.check_integrity()
    while llm.has_unfinished():  # the hog ends and frees its blocks
        llm.step()
    assert hog.is_finished
    (want,) = reference_llm.generate([PROMPT], GREEDY)
    (got,) = llm.generate([PROMPT], GREEDY)
    assert got.text == want.text
    assert got.num_cached_tokens == len(values) * llm.config.block_size  # none computed


def test_a_pull_with_a_salt_that_is_no_string_is_refused(tiny_llama_tok_dir: Path) -> None:
    llm = _decode_llm(tiny_llama_tok_dir, 16)
    params = {"prompt_token_ids": [1, 2, 3], "transport": "zmq", "handover_id": "h"}
    puller = Puller(llm)
    try:
        with pytest.raises(ValueError, match="cache_salt must be a string, got int"):
            puller.pull(params | {"cache_salt": 5})
    finally:
        puller.close()
