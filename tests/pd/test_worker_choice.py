"""The router sends a request to the prefill worker, and its handover to the decode worker, that
already hold the prompt's leading blocks (cache-aware, as `kvcache router` picks replicas): a
conversation's next turn goes back to the workers of its first turn, so the prefill worker
computes only the new tokens and the decode worker pulls only the new blocks; an unrelated
prompt goes to the other, idler workers. Answers stay the colocated engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from kvcache import LLM, SamplingParams
from runner.router.pd import build_pd_router_app
from runner.router.proxy import RouterSettings
from tests.pd.conftest import Worker, WorkerFactory
from tests.pd.test_handover import PROMPT
from tests.pd.test_router_pd import pd_router
from tests.serve.conftest import LiveServer

FIRST_TURN = PROMPT
NEXT_TURN = PROMPT + "The decoder then answers the next turn of the same conversation."
UNRELATED = "An unrelated request about gardens, rivers and the weather in early spring. " * 2


def _disagg(worker: Worker) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{worker.url}/kvcache/disagg").json()
    return stats


def test_a_conversation_goes_back_to_the_workers_that_hold_it(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0)
    with (
        worker("prefill") as prefill_a,
        worker("prefill") as prefill_b,
        worker("decode") as decode_a,
        worker("decode") as decode_b,
        pd_router([prefill_a.url, prefill_b.url], [decode_a.url, decode_b.url]) as router,
    ):
        prompt_tokens = []
        for prompt in (FIRST_TURN, UNRELATED, NEXT_TURN):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
            answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            (want,) = reference_llm.generate([prompt], params)
            assert answer.json()["choices"][0]["text"] == want.text
            prompt_tokens.append(answer.json()["usage"]["prompt_tokens"])
        published = [_disagg(w)["published"] for w in (prefill_a, prefill_b)]
        pulled = [_disagg(w)["pulled"] for w in (decode_a, decode_b)]
        routes = httpx.get(f"{router.url}/router/stats").json()
        hits = [w.llm.stats()["hit_tokens"] for w in (prefill_a, prefill_b)]
    block = decode_a.llm.config.block_size
    # The first turn and its next on one prefill worker, which then computed only the new
    # tokens; the unrelated prompt on the other.
    assert sorted(p["handovers"] for p in published) == [1, 2]
    holder = 0 if published[0]["handovers"] == 2 else 1
    assert hits[holder] >= (prompt_tokens[0] - 1) // block * block and hits[1 - holder] == 0
    # Likewise on the decode side: every full block of the first turn's prompt is not sent
    # again (the one holding its last token was computed there, and cached there too).
    assert sorted(p["pulls"] for p in pulled) == [1, 2]
    holder_pulls = pulled[0] if pulled[0]["pulls"] == 2 else pulled[1]
    assert holder_pulls["skipped_blocks"] == prompt_tokens[0] // block
    assert routes["prefill_routes"].get("prefix_match") == 1
    assert routes["decode_routes"].get("prefix_match") == 1


def test_a_tokenizer_that_cannot_load_means_the_least_busy_prefill_worker(
    worker: WorkerFactory, reference_llm: LLM, tmp_path: Path
) -> None:
    settings = RouterSettings(health_interval_s=0.1, tokenizer=str(tmp_path / "no-such-model"))
    params = SamplingParams(max_tokens=8, temperature=0)
    (want,) = reference_llm.generate([PROMPT], params)
    # Two prefill workers: with one there is no choice, and no prompt is tokenized.
    with worker("prefill") as prefill, worker("prefill") as other, worker("decode") as decode:
        prefills = [prefill.url, other.url]
        router = LiveServer(build_pd_router_app(prefills, [decode.url], settings)).start()
        try:
            for _ in range(2):  # the second does not try the tokenizer again
                body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
                answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["text"] == want.text
            pd = router.app.state.router
            assert pd.prompt_tokens.failed and pd.prompt_tokens.hasher is None
        finally:
            router.stop()


def test_with_one_prefill_worker_no_prompt_is_tokenized(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    """No choice to make: the router relays the request without tokenizing its prompt (which
    would hold up the streams it relays), and the answer is the colocated engine's."""
    params = SamplingParams(max_tokens=8, temperature=0)
    (want,) = reference_llm.generate([PROMPT], params)
    with (
        worker("prefill") as prefill,
        worker("decode") as decode,
        pd_router([prefill.url], [decode.url]) as router,
    ):
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == want.text
        tokens = router.app.state.router.prompt_tokens
        assert tokens.hasher is None and not tokens.failed
