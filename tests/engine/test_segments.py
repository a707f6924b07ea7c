"""Prompts given as segments (runner/engine/step/segments.py): later segments cached on their own
and reused after other prefixes, in other orders; blend_ratio 1 is the plain engine; blended K/V
never serve a later prompt as an exact prefix; chunking, preemption, tiers, a restart, n > 1,
streaming, salts and bad segments."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from tests.conftest import load_hf_reference
from tests.greedy_reference import hf_greedy
from tests.redis_server import RedisServer

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def corpus(vocab: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """A system prompt, five documents of 40 to 70 tokens and four questions (token ids)."""
    rng = random.Random(7)
    system = [rng.randrange(3, vocab) for _ in range(21)]
    docs = [[rng.randrange(3, vocab) for _ in range(rng.randrange(40, 70))] for _ in range(5)]
    questions = [[rng.randrange(3, vocab) for _ in range(9)] for _ in range(4)]
    return system, docs, questions


def segmented(system: list[int], docs: list[list[int]], order: list[int], q: list[int]) -> dict:
    return {"segments": [system] + [docs[i] for i in order] + [q]}


def joined(prompt: dict) -> list[int]:
    return [t for segment in prompt["segments"] for t in segment]


@pytest.fixture
def parts(tiny_llama_dir: Path) -> tuple[list[int], list[list[int]], list[list[int]]]:
    return corpus(256)


def test_ratio_one_is_the_plain_engine(tiny_llama_dir: Path, parts: tuple) -> None:
    """blend_ratio 1 recomputes everything: the outputs of the joined tokens, which are
    transformers' greedy answers, and nothing is reused."""
    system, docs, questions = parts
    prompts = [segmented(system, docs, [0, 1, 2], questions[0])] * 2 + [
        segmented(system, docs, [2, 0, 1], questions[1])
    ]
    llm = LLM(str(tiny_llama_dir), blend_ratio=1.0)
    outs = llm.generate(prompts, GREEDY)
    hf = load_hf_reference(tiny_llama_dir)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, joined(prompt), 8, None)
        assert out.num_reused_segment_tokens == 0
    assert llm.stats()["segment_hit_tokens"] == 0


def test_a_segment_is_cached_on_its_second_sighting_and_reused_after(
    tiny_llama_dir: Path, parts: tuple
) -> None:
    """Seen once: computed in its prompt, nothing cached for it. Seen again (in another order,
    after another question): computed alone, cached, and reused. A third time: reused from the
    cache at once; the report counts asked, served and recomputed tokens."""
    system, docs, questions = parts
    llm = LLM(str(tiny_llama_dir), blend_ratio=0.25, block_size=16)
    first = llm.generate(segmented(system, docs, [0, 1, 2], questions[0]), GREEDY)[0]
    assert first.num_reused_segment_tokens == 0
    assert llm.stats()["segments_filled"] == 0
    second = llm.generate(segmented(system, docs, [2, 0, 1], questions[1]), GREEDY)[0]
    stats = llm.stats()
    assert stats["segments_filled"] == 3
    full_blocks = sum(len(docs[i]) // 16 * 16 for i in (2, 0, 1))
    assert second.num_reused_segment_tokens == full_blocks
    third = llm.generate(segmented(system, docs, [1, 2, 0], questions[2]), GREEDY)[0]
    assert third.num_reused_segment_tokens == full_blocks
    stats = llm.stats()
    assert stats["segments_filled"] == 3  # nothing computed alone again
    assert stats["segment_hit_tokens"] == 2 * full_blocks
    assert 0.25 <= stats["segment_recompute_fraction"] < 0.27  # ceil(0.25 * tokens)
    assert third.to_record()["reused_segment_tokens"] == full_blocks
    llm.check_integrity()


def test_blended_kv_is_never_served_as_an_exact_prefix(tiny_llama_dir: Path, parts: tuple) -> None:
    """After a blended request, the same tokens sent plain find only the exact prefix cached
    (the system prompt), and their answer is transformers' greedy one."""
    system, docs, questions = parts
    llm = LLM(str(tiny_llama_dir), blend_ratio=0.0, block_size=16)
    llm.generate(segmented(system, docs, [3, 4], questions[0]), GREEDY)  # seen
    llm.generate(segmented(system, docs, [4, 3], questions[1]), GREEDY)  # cached alone
    prompt = segmented(system, docs, [4, 3], questions[2])
    out = llm.generate(prompt, GREEDY)[0]
    assert out.num_reused_segment_tokens > 0
    plain = llm.generate([joined(prompt)], GREEDY)[0]
    assert plain.num_cached_tokens <= len(system)
    hf = load_hf_reference(tiny_llama_dir)
    assert plain.token_ids == hf_greedy(hf, joined(prompt), 8, None)
    llm.check_integrity()


def test_chunks_preemption_and_batching_change_nothing(tiny_llama_dir: Path, parts: tuple) -> None:
    """deterministic=True: the blended requests' tokens, run alone with a large token budget,
    equal theirs in one batch with 16-token chunks in a pool so small that requests are
    preempted and blended again on re-admission."""
    system, docs, questions = parts
    orders = [[0, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1], [2, 0, 1], [1, 2, 0]]
    prompts = [segmented(system, docs, o, questions[i % 4]) for i, o in enumerate(orders)]
    long = SamplingParams(max_tokens=24, temperature=0)
    # Seen twice after another system prompt: cached alone, and no prompt's prefix.
    warm = [segmented(questions[3], docs, o, questions[3]) for o in orders[:2]]
    alone = LLM(str(tiny_llama_dir), blend_ratio=0.2, deterministic=True)
    alone.generate(warm, long)
    expected = [alone.generate(p, long)[0] for p in prompts]
    assert all(o.num_reused_segment_tokens > 0 for o in expected)
    tight = LLM(
        str(tiny_llama_dir),
        blend_ratio=0.2,
        deterministic=True,
        max_num_batched_tokens=16,
        num_kv_blocks=24,
    )
    tight.generate(warm, long)
    got = tight.generate(prompts, long)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    tight.check_integrity()


def test_segments_come_back_from_a_disk_tier_after_a_restart(
    tiny_llama_dir: Path, parts: tuple, tmp_path: Path
) -> None:
    """Segments cached by one engine are reused by the next on their first sighting there:
    they live in the same tiers as prefixes, keyed by their own tokens."""
    system, docs, questions = parts
    disk = str(tmp_path / "disk")
    first = LLM(str(tiny_llama_dir), blend_ratio=0.2, disk_cache_dir=disk)
    for order in ([0, 1], [1, 0]):
        first.generate(segmented(system, docs, order, questions[0]), GREEDY)
    first.flush_cache_tiers()
    del first
    second = LLM(str(tiny_llama_dir), blend_ratio=0.2, disk_cache_dir=disk)
    out = second.generate(segmented(system, docs, [1, 0], questions[3]), GREEDY)[0]
    assert out.num_reused_segment_tokens == sum(len(docs[i]) // 16 * 16 for i in (0, 1))
    assert second.stats()["segments_filled"] == 0
    second.check_integrity()


def test_a_segment_cached_by_one_replica_is_reused_by_another(
    tiny_llama_dir: Path, parts: tuple, redis_server: RedisServer
) -> None:
    """Two engines sharing a Redis tier: a document cached alone by one is reused by the other
    on its first sighting there, after another system prompt, with its host tier on too."""
    system, docs, questions = parts
    one = LLM(str(tiny_llama_dir), blend_ratio=0.2, remote_cache_url=redis_server.url)
    for i, order in enumerate(([2, 3], [3, 2])):
        one.generate(segmented(questions[i], docs, order, questions[i]), GREEDY)
    one.flush_cache_tiers()
    other = LLM(
        str(tiny_llama_dir),
        blend_ratio=0.2,
        remote_cache_url=redis_server.url,
        host_cache_bytes=2**20,
    )
    out = other.generate(segmented(system, docs, [3, 2], questions[3]), GREEDY)[0]
    assert out.num_reused_segment_tokens == sum(len(docs[i]) // 16 * 16 for i in (2, 3))
    other.check_integrity()


def test_a_salt_keeps_segments_apart(tiny_llama_dir: Path, parts: tuple) -> None:
    """A segment cached under one tenant's cache_salt is never reused under another's."""
    system, docs, questions = parts
    llm = LLM(str(tiny_llama_dir), blend_ratio=0.2)
    for i, order in enumerate(([0, 1], [1, 0], [1, 0])):
        own = llm.generate(segmented(system, docs, order, questions[i]), GREEDY, cache_salt="a")
    assert own[0].num_reused_segment_tokens > 0
    other = llm.generate(segmented(system, docs, [1, 0], questions[1]), GREEDY, cache_salt="b")
    assert other[0].num_reused_segment_tokens == 0


def test_samples_streams_and_stop_strings_with_segments(tiny_llama_tok_dir: Path) -> None:
    """Text segments: n = 2 greedy samples are equal and equal n = 1; a stream's deltas add up
    to the output; a stop string cuts the text, all with segments reused."""
    llm = LLM(str(tiny_llama_tok_dir), blend_ratio=0.2)
    docs = ["The river Wensum runs through the city. " * 3, "Bread rises when yeast eats. " * 3]
    prompt = {"segments": ["Read these notes.\n", docs[0], docs[1], "\nWhat is said?"]}
    for opening in ("Notes:\n", "Some notes follow.\n"):  # seen, then cached alone
        llm.generate({"segments": [opening, docs[1], docs[0], "\nSay it."]}, GREEDY)
    one = llm.generate(prompt, GREEDY)[0]
    assert one.num_reused_segment_tokens > 0
    two = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, n=2))[0]
    assert [o.token_ids for o in two.outputs] == [one.token_ids, one.token_ids]
    text = "".join(d.text for d in llm.stream(prompt, GREEDY))
    assert text == one.text
    stop = one.text[2:4]
    if stop.strip():
        cut = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, stop=[stop]))[0]
        assert cut.text == one.text[: one.text.index(stop)]
    llm.check_integrity()


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([], "segments is empty"),
        ([[5, 6], []], "segment 1 is empty"),
        ([[5, 6], "  "], "segment 1 is empty"),
        ([[5, 6], 7], "segment 1 must be text or a list of token ids"),
        ([[5]] * 300, "at most 256"),
        ([[5] * 300, [6] * 300], "the model's context holds"),
        ("text", "segments must be a list"),
    ],
)
def test_bad_segments_are_named(tiny_llama_dir: Path, segments: object, message: str) -> None:
    llm = LLM(str(tiny_llama_dir), blend_ratio=0.2, max_model_len=512)
    with pytest.raises(ValueError, match=message):
        llm.generate({"segments": segments}, GREEDY)
    assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"  # the rest goes on


def test_a_prompt_dict_holds_segments_or_a_prompt(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    with pytest.raises(ValueError, match="'segments' or 'prompt'"):
        llm.generate({"segments": [[5]], "prompt_token_ids": [5]}, GREEDY)


def test_blend_ratio_is_checked() -> None:
    with pytest.raises(ValueError, match="blend_ratio must be in"):
        LLM(blend_ratio=1.5)


def test_a_prompt_sets_its_own_blend_ratio(tiny_llama_dir: Path, parts: tuple) -> None:
    """A prompt's blend_ratio wins over the engine's: 1 runs it as plain tokens (transformers'
    answer) on an engine that blends; 0.5 recomputes half of each reused segment."""
    system, docs, questions = parts
    llm = LLM(str(tiny_llama_dir), blend_ratio=0.0)
    for i, order in enumerate(([0, 1], [1, 0])):
        llm.generate(segmented(questions[i], docs, order, questions[i]), GREEDY)
    plain = {**segmented(system, docs, [0, 1], questions[2]), "blend_ratio": 1}
    out = llm.generate(plain, GREEDY)[0]
    assert out.num_reused_segment_tokens == 0
    hf = load_hf_reference(tiny_llama_dir)
    assert out.token_ids == hf_greedy(hf, joined(plain), 8, None)
    half = {**segmented(system, docs, [1, 0], questions[3]), "blend_ratio": 0.5}
    before = llm.stats()["segment_recomputed_tokens"]
    reused = llm.generate(half, GREEDY)[0].num_reused_segment_tokens
    assert reused > 0
    assert llm.stats()["segment_recomputed_tokens"] - before >= reused / 2
    with pytest.raises(ValueError, match="blend_ratio must be a number in"):
        llm.generate({**half, "blend_ratio": "x"}, GREEDY)
    with pytest.raises(ValueError, match="applies to a prompt given as 'segments'"):
        llm.generate({"prompt_token_ids": [5, 6], "blend_ratio": 0.5}, GREEDY)


def test_a_failing_blend_or_fill_leaves_the_request_exact(
    tiny_llama_dir: Path, parts: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blend that raises (or a segment's caching that raises) fails nothing: the request is
    computed as plain tokens, transformers' answer, and the pool stays intact."""
    system, docs, questions = parts
    llm = LLM(str(tiny_llama_dir), blend_ratio=0.2)
    hf = load_hf_reference(tiny_llama_dir)

    def boom(*args: object) -> int:
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.runner, "compute_kv", boom)  # the fill of the second sighting
    for i, order in enumerate(([0, 1], [1, 0])):
        prompt = segmented(questions[i], docs, order, questions[i])
        out = llm.generate(prompt, GREEDY)[0]
        assert out.token_ids == hf_greedy(hf, joined(prompt), 8, None)
    assert llm.stats()["segments_filled"] == 0
    monkeypatch.undo()
    llm.generate(segmented(questions[2], docs, [0, 1], questions[2]), GREEDY)  # cached now
    monkeypatch.setattr(llm.runner, "place_and_blend", boom)
    prompt = segmented(system, docs, [1, 0], questions[3])
    out = llm.generate(prompt, GREEDY)[0]
    assert out.num_reused_segment_tokens == 0
    assert out.token_ids == hf_greedy(hf, joined(prompt), 8, None)
    llm.check_integrity()
