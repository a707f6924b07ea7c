"""Random interleavings of the engine's public calls (add requests of one or several samples,
step, abort) on a small pool: every request comes back exactly once (from `step` or from
`abort_request`) with all its samples, the block manager stays sound after every call, and at
the end nothing is live and no block is held."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import LLM, RequestOutput, SamplingParams

_ENGINES: dict[str, LLM] = {}


def engine(path: Path) -> LLM:
    """One engine for every example (building one per example would dominate the test); each
    example starts from an idle engine, which the previous one leaves behind."""
    if str(path) not in _ENGINES:
        _ENGINES[str(path)] = LLM(str(path), num_kv_blocks=24, block_size=4, max_num_seqs=6)
    llm = _ENGINES[str(path)]
    assert not llm.has_unfinished()
    return llm


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        max_tokens=rng.randint(1, 6),
        temperature=rng.choice([0.0, 0.8]),
        seed=rng.choice([None, rng.randrange(100)]),
        n=rng.choice([1, 1, 2, 3]),
        logprobs=rng.choice([None, 0, 2]),
        repetition_penalty=rng.choice([1.0, 1.3]),
        ignore_eos=rng.random() < 0.5,
    )


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), operations=st.integers(5, 40))
def test_add_step_abort_in_any_order(tiny_llama_dir: Path, seed: int, operations: int) -> None:
    rng = random.Random(seed)
    llm = engine(tiny_llama_dir)
    shared = [rng.randrange(3, 300) for _ in range(9)]
    added: dict[str, SamplingParams] = {}
    returned: dict[str, RequestOutput] = {}

    def collect(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.request_id in added and out.request_id not in returned
            returned[out.request_id] = out

    for op in range(operations):
        roll = rng.random()
        if roll < 0.35:
            prompt = (shared if rng.random() < 0.6 else []) + [
                rng.randrange(3, 300) for _ in range(rng.randint(1, 12))
            ]
            params = random_params(rng)
            request_id = f"r{op}"
            llm.add_request(prompt, params, request_id=request_id)
            added[request_id] = params
        elif roll < 0.85:
            collect(llm.step())
        else:
            live = [r for r in added if r not in returned]
            if live:
                aborted = llm.abort_request(rng.choice(live))
                assert aborted is not None
                collect([aborted])
        llm.block_manager.check_integrity()
    collect(llm.run_until_done())
    llm.block_manager.check_integrity()
    assert set(returned) == set(added)
    for request_id, out in returned.items():
        params = added[request_id]
        assert len(out.outputs) == params.n
        for sample in out.outputs:
            assert sample.finish_reason in ("stop", "length", "abort")
            assert len(sample.token_ids) <= params.max_tokens
            if sample.finish_reason == "length":
                assert len(sample.token_ids) == params.max_tokens
            if params.logprobs is None:
                assert sample.logprobs is None
            else:
                assert sample.logprobs is not None
                assert len(sample.logprobs) == len(sample.token_ids)
    assert not llm.has_unfinished()
    assert llm._requests.is_empty()  # no request or sample group kept after it ended
    assert llm.block_manager.stats.blocks_in_use == 0
