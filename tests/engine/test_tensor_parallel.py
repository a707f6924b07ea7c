"""Tensor parallelism with two gloo ranks on this machine (runner/model/tensor_parallel.py,
runner/engine/executor/multiproc.py): greedy tokens equal transformers' on every architecture,
with prefix hits, chunks, preemption, streaming, several samples, structured outputs, guessed
tokens, prompt log-probabilities and segments; deterministic mode bitwise equal to itself
whatever the batch; a killed rank ends the engine with an error naming it; nothing is left
behind at shutdown."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

from kvcache import LLM, SamplingParams
from runner.engine.executor.multiproc import MultiprocExecutor, WorkersFailed
from runner.model.tensor_parallel import HeadShare, head_share
from tests.engine.test_segments import corpus, segmented
from tests.greedy_reference import ARCH_FIXTURES, assert_greedy_matches, hf_references

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def ranks_of(llm: LLM) -> MultiprocExecutor:
    executor = llm.executor
    assert isinstance(executor, MultiprocExecutor)
    return executor


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "shares"),
    [
        # The default model's 9 query heads in 3 groups over 2 ranks: 2 groups and 1.
        (9, 3, 2, [HeadShare(0, 6, 0, 2, True), HeadShare(6, 9, 2, 3, True)]),
        (4, 2, 2, [HeadShare(0, 2, 0, 1, True), HeadShare(2, 4, 1, 2, True)]),
        # Fewer KV heads than ranks: each replicated on the ranks that split its queries.
        (
            8,
            2,
            4,
            [
                HeadShare(0, 2, 0, 1, True),
                HeadShare(2, 4, 0, 1, False),
                HeadShare(4, 6, 1, 2, True),
                HeadShare(6, 8, 1, 2, False),
            ],
        ),
        (
            6,
            1,
            3,
            [
                HeadShare(0, 2, 0, 1, True),
                HeadShare(2, 4, 0, 1, False),
                HeadShare(4, 6, 0, 1, False),
            ],
        ),
    ],
)
def test_heads_split_by_whole_groups(
    heads: int, kv_heads: int, size: int, shares: list[HeadShare]
) -> None:
    assert [head_share(heads, kv_heads, size, r) for r in range(size)] == shares


def test_more_ranks_than_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=8 is more than the model's 4"):
        head_share(4, 2, 8, 0)


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_two_ranks_give_transformers_greedy_tokens(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """Batched cold, batched warm (prefix hits) and alone: transformers' unbatched greedy
    tokens, with the model's heads, MLP and vocabulary split over two processes."""
    from tests.conftest import load_hf_reference

    path = request.getfixturevalue(fixture)
    prompts, refs = hf_references(load_hf_reference(path), seed=3)
    llm = LLM(str(path), tensor_parallel_size=2)
    assert_greedy_matches(llm, prompts, refs, alone=True)
    llm.check_integrity()


def test_the_default_models_uneven_heads(default_model_dir: Path) -> None:
    """SmolLM2's 9 query heads and 3 KV heads over 2 ranks (2 groups and 1; vLLM refuses
    such a split): the tokens of one rank. Prompts share a prefix, so the cache hits."""
    prompts = ["The capital of France is", "The capital of France is a city that"]
    params = SamplingParams(max_tokens=8, temperature=0)
    one = [o.token_ids for o in LLM(str(default_model_dir)).generate(prompts, params)]
    llm = LLM(str(default_model_dir), tensor_parallel_size=2)
    assert [o.token_ids for o in llm.generate(prompts, params)] == one
    assert llm.model.num_heads == 6 and llm.model.num_kv_heads == 2  # rank 0's share


def test_chunks_preemption_samples_streams_logprobs_and_drafts(tiny_llama_tok_dir: Path) -> None:
    """One engine of two ranks through the engine's features: small chunks and a pool small
    enough to preempt, several samples a prompt, a stream, prompt log-probabilities and
    guessed tokens (n-gram lookup) give what one rank gives."""
    options = dict(max_num_batched_tokens=24, num_kv_blocks=12, block_size=8, speculative_tokens=3)
    prompts = ["abcabcabcabcabc the", "hello hello hello hello", "xyz" * 9]
    params = SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=2, logprobs=2)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=2)
    one = LLM(str(tiny_llama_tok_dir), **options)
    two = LLM(str(tiny_llama_tok_dir), tensor_parallel_size=2, **options)
    for a, b in zip(one.generate(prompts, params), two.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [p and sorted(p) for p in a.prompt_logprobs] == [
            p and sorted(p) for p in b.prompt_logprobs
        ]
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            for token in x:
                assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)
    greedy = SamplingParams(max_tokens=12, temperature=0)  # plain greedy rows: drafts run
    assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy)] == [
        o.outputs[0].token_ids for o in one.generate(prompts, greedy)
    ]
    assert two.spec_stats.num_draft_tokens > 0 and two.scheduler.num_preemptions > 0
    assert two.spec_stats == one.spec_stats
    assert [o.outputs[j].token_ids for o in two.generate(prompts, sampled) for j in range(2)] == [
        o.outputs[j].token_ids for o in one.generate(prompts, sampled) for j in range(2)
    ]
    streamed = [t for delta in two.stream(prompts[0], params) for t in delta.token_ids]
    assert streamed == one.generate(prompts[0], params)[0].outputs[0].token_ids
    two.check_integrity()


def test_structured_outputs_and_segments(tiny_llama_tok_dir: Path) -> None:
    """A JSON schema's constrained answer, and prompts given as segments (cached alone and
    blended, every rank picking the same tokens to recompute), as one rank gives them."""
    from runner.sampling.params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(
        max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    one = LLM(str(tiny_llama_tok_dir), blend_ratio=0.3)
    two = LLM(str(tiny_llama_tok_dir), blend_ratio=0.3, tensor_parallel_size=2)
    a, b = one.generate("json:", params)[0], two.generate("json:", params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert b.outputs[0].text.startswith("{")  # constrained (the answer may stop mid-object)
    system, docs, questions = corpus(256)
    prompts = [
        segmented(system, docs, order, q)
        for order, q in (
            ([0, 1, 2], questions[0]),
            ([2, 0, 1], questions[1]),
            ([1, 2, 0], questions[2]),
        )
    ]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    for prompt in prompts:
        x, y = one.generate(prompt, greedy)[0], two.generate(prompt, greedy)[0]
        assert y.num_reused_segment_tokens == x.num_reused_segment_tokens
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
    assert two.stats()["segment_hit_tokens"] > 0
    two.check_integrity()


def test_deterministic_two_ranks_equal_themselves_whatever_the_batch(
    tiny_llama_dir: Path,
) -> None:
    """deterministic=True: each prompt's log-probabilities bitwise the same alone and in a
    batch of all, chunked differently."""
    prompts = [[5 + i, 9, 40 + 3 * i] * (4 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    llm = LLM(
        str(tiny_llama_dir), tensor_parallel_size=2, deterministic=True, enable_prefix_caching=False
    )
    together = llm.generate(prompts, params)
    for prompt, batched in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], params)[0]
        assert alone.outputs[0].token_ids == batched.outputs[0].token_ids
        assert alone.outputs[0].logprobs == batched.outputs[0].logprobs


def test_a_killed_rank_ends_the_engine_with_an_error(tiny_llama_dir: Path) -> None:
    """Rank 1 killed: the next calls end at once (no hang) with an error naming the rank,
    raised or as each request's error, and no process is left."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2)
    ranks = ranks_of(llm)
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    ranks.processes[0].kill()
    ranks.processes[0].join(timeout=10)
    started = time.monotonic()
    for prompt in ([5, 6, 7, 8], [9, 10]):
        try:
            out = llm.generate([prompt], GREEDY)[0]
        except WorkersFailed as err:
            why = str(err)
        else:
            assert out.finish_reason == "error" and out.error is not None
            why = out.error
        assert "rank 1 exited" in why
    assert time.monotonic() - started < 60
    assert not any(p.is_alive() for p in ranks.processes)


def test_shutdown_leaves_no_process(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2)
    processes = list(ranks_of(llm).processes)
    assert processes and all(p.is_alive() for p in processes)
    llm.shutdown()
    assert not any(p.is_alive() for p in processes)
    del llm
    gc.collect()


def test_a_collected_engine_stops_its_ranks(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2)
    processes = list(ranks_of(llm).processes)
    del llm
    gc.collect()
    for process in processes:
        process.join(timeout=20)
    assert not any(p.is_alive() for p in processes)


def test_bad_sizes_are_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=8 is more than"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=8)


def test_a_disk_tier_after_a_restart_is_found_by_the_same_size_only(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A TP=2 engine's blocks, written to a disk tier, come back to the next TP=2 engine
    after a restart (each value holds both ranks' shards); a TP=1 engine on the same
    directory misses them cleanly and computes the same tokens."""
    prompts = [[7 + i % 5 for i in range(70)] + [i] for i in range(3)]
    options = dict(disk_cache_dir=str(tmp_path), block_size=16, num_kv_blocks=24)
    first = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **options)
    want = [o.outputs[0].token_ids for o in first.generate(prompts, GREEDY)]
    first.flush_cache_tiers()
    first.shutdown()
    del first
    gc.collect()
    again = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **options)
    outs = again.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].num_cached_tokens == 64  # from the disk: the pool started empty
    again.check_integrity()
    one = LLM(str(tiny_llama_dir), **options)
    outs = one.generate(prompts, GREEDY)
    assert outs[0].num_cached_tokens == 0  # another sharding: a miss, never wrong K/V
    assert [o.outputs[0].token_ids for o in outs] == want


def test_blocks_handed_over_between_two_rank_engines(tiny_llama_tok_dir: Path) -> None:
    """A prefill engine's cached blocks (every rank's shard) pass the decode side's checks
    and, installed into another TP=2 engine's pool, serve its prompt; a TP=1 engine refuses
    them (another layout)."""
    from runner.disagg.blocks import check_values, prompt_chain

    tokens = list(range(5, 60))
    options = dict(block_size=4, num_kv_blocks=64, host_cache_bytes=1 << 22)
    prefill = LLM(str(tiny_llama_tok_dir), tensor_parallel_size=2, **options)
    params = SamplingParams(max_tokens=6, temperature=0)
    (want,) = prefill.generate([tokens], params)
    values = prefill.cached_block_values(tokens, None)
    decode = LLM(str(tiny_llama_tok_dir), tensor_parallel_size=2, **options)
    checked = check_values(decode, prompt_chain(decode, tokens, None), 0, values)
    assert checked.passed == len(values) > 3
    assert decode.install_blocks(tokens, None, 0, checked.kvs).loaded == len(values)
    (got,) = decode.generate([tokens], params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens == len(values) * 4
    one = LLM(str(tiny_llama_tok_dir), **options)
    assert check_values(one, prompt_chain(one, tokens, None), 0, values).passed == 0
    with pytest.raises(ValueError, match="save_prefix_cache takes one rank's pool"):
        decode.save_prefix_cache("/nonexistent/cache.kv")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_two_gpus_give_one_gpus_tokens(tiny_llama_dir: Path) -> None:
    """NCCL between cuda:0 and cuda:1 (scripts/gpu_tp_check.sh): the tokens of one GPU."""
    prompts = [[5 + i, 9, 40 + 3 * i] * (4 + 3 * i) for i in range(6)]
    options = dict(device="cuda", dtype="float32")
    one = [
        o.outputs[0].token_ids
        for o in LLM(str(tiny_llama_dir), **options).generate(prompts, GREEDY)
    ]
    two = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **options)
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)] == one
