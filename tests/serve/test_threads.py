"""One LLM called from several threads at once: each caller gets exactly the single-threaded
greedy answers, the block manager's invariants hold after, and nothing half-computed stays
cached (the same prompts later, on the same engine, give the same text)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from kvcache import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0)
SHARED = "A shared system prompt that several threads send at once: "


def thread_prompts(i: int) -> list[str]:
    """Prompts of thread i: a prefix shared by every thread (cache hits across threads) and
    one of its own."""
    return [SHARED + f"question {i}.{j}" for j in range(3)] + [f"thread {i} alone " * (1 + i)]


def run_threads(llm: LLM, num_threads: int, streaming: bool) -> dict[int, list[str]]:
    """Each thread generates (or streams) its prompts on the one `llm`; returns their texts."""
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(num_threads)

    def work(i: int) -> None:
        try:
            start.wait()
            prompts = thread_prompts(i)
            for _ in range(2):  # the second round hits what the first (of any thread) cached
                if streaming and i % 2:
                    texts = [""] * len(prompts)
                    for delta in llm.stream(prompts, GREEDY):
                        texts[delta.index] += delta.text
                else:
                    texts = [o.text for o in llm.generate(prompts, GREEDY)]
                assert results.setdefault(i, texts) == texts, f"thread {i}: rounds differ"
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


def test_threads_share_one_llm(tiny_llama_tok_dir: Path) -> None:
    num_threads = 4
    reference = LLM(str(tiny_llama_tok_dir), num_kv_blocks=64)
    expected = {
        i: [o.text for o in reference.generate(thread_prompts(i), GREEDY)]
        for i in range(num_threads)
    }
    # A small pool: threads' requests evict and preempt each other's blocks.
    llm = LLM(str(tiny_llama_tok_dir), num_kv_blocks=24, max_num_batched_tokens=48)
    for streaming in (False, True):
        got = run_threads(llm, num_threads, streaming)
        assert got == expected
        llm.block_manager.check_integrity()
        assert not llm.has_unfinished()
    # What the threads left cached is correct K/V: the same prompts, now one caller at a time.
    for i in range(num_threads):
        assert [o.text for o in llm.generate(thread_prompts(i), GREEDY)] == expected[i]
    llm.block_manager.check_integrity()
    assert llm.stats()["hit_tokens"] > 0  # the threads did share cached prefixes


def test_a_failed_step_caches_none_of_its_kv(tiny_llama_tok_dir: Path, monkeypatch: Any) -> None:
    """A step that fails after the model wrote K/V (in the forward pass, or in the bookkeeping
    after it) ends its requests as errors and publishes none of what it wrote: the same prompts
    later give the reference text, and the invariants hold."""
    prompts = [SHARED + "first", SHARED + "second one, longer than the first"]
    reference = [o.text for o in LLM(str(tiny_llama_tok_dir)).generate(prompts, GREEDY)]
    for target in ("runner", "stopper"):
        llm = LLM(str(tiny_llama_tok_dir))
        owner, name = (llm.runner, "run") if target == "runner" else (llm.stopper, "record_tokens")
        real, calls = getattr(owner, name), [0]

        def fail_from_third(*args: Any, real: Any = real, calls: list[int] = calls) -> Any:
            result = real(*args)  # K/V written (and tokens recorded) before the failure
            calls[0] += 1
            if calls[0] >= 3:  # every call from the third on: a retry fails as well
                raise RuntimeError("device fell over")
            return result

        monkeypatch.setattr(owner, name, fail_from_third)
        failed = llm.generate(prompts, GREEDY)
        assert [o.finish_reason for o in failed] == ["error", "error"], target
        assert all("device fell over" in (o.error or "") for o in failed)
        llm.block_manager.check_integrity()
        monkeypatch.setattr(owner, name, real)
        assert [o.text for o in llm.generate(prompts, GREEDY)] == reference, target
        llm.block_manager.check_integrity()
