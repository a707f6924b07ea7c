"""The router sends a handover to the decode worker that already holds the prompt's leading
blocks (cache-aware, as `kvcache router` picks replicas): a conversation's next turn goes back
to the worker that decoded its first, which then pulls only the new blocks; an unrelated prompt
goes to the other, idler one. Answers stay the colocated engine's."""

from __future__ import annotations

import httpx

from kvcache import LLM, SamplingParams
from tests.pd.conftest import WorkerFactory
from tests.pd.test_handover import PROMPT
from tests.pd.test_router_pd import pd_router

FIRST_TURN = PROMPT
NEXT_TURN = PROMPT + "The decoder then answers the next turn of the same conversation."
UNRELATED = "An unrelated request about gardens, rivers and the weather in early spring. " * 2


def test_a_conversation_goes_back_to_the_decode_worker_that_holds_it(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0)
    with (
        worker("prefill") as prefill,
        worker("decode") as first,
        worker("decode") as second,
        pd_router([prefill.url], [first.url, second.url]) as router,
    ):
        prompt_tokens = []
        for prompt in (FIRST_TURN, UNRELATED, NEXT_TURN):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
            answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            (want,) = reference_llm.generate([prompt], params)
            assert answer.json()["choices"][0]["text"] == want.text
            prompt_tokens.append(answer.json()["usage"]["prompt_tokens"])
        pulled = [httpx.get(f"{w.url}/kvcache/disagg").json()["pulled"] for w in (first, second)]
        routes = httpx.get(f"{router.url}/router/stats").json()["decode_routes"]
    # The first turn and its next on one worker, the unrelated prompt on the other.
    assert sorted(p["pulls"] for p in pulled) == [1, 2]
    holder = pulled[0] if pulled[0]["pulls"] == 2 else pulled[1]
    # Every full block of the first turn's prompt, not sent again (the one holding its last
    # token was computed by that worker, and cached there too).
    assert holder["skipped_blocks"] == prompt_tokens[0] // first.llm.config.block_size
    assert routes.get("prefix_match") == 1
