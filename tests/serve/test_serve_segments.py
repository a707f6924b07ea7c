"""`segments` on /v1/completions (ours, beside OpenAI's fields): through the official openai
client's extra_body, streamed and not, the answers are the engine's own for the same segments,
usage says the reused segment tokens, /metrics shows segment hits, and bad segments are 400s
naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai

from kvcache import LLM, SamplingParams
from tests.serve.conftest import ServeFactory

DOCS = [
    "The Wensum is a river in Norfolk; it flows through Norwich and joins the Yare. ",
    "Bread rises because yeast eats sugar and gives off gas that the dough traps. ",
    "A block table maps a request's positions to the blocks that hold their keys. ",
]


def prompt(opening: str, order: list[int], question: str) -> list[str]:
    return [opening] + [DOCS[i] for i in order] + [question]


def test_segments_through_the_openai_client(serve: ServeFactory, tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir), blend_ratio=0.3)
    reference = LLM(str(tiny_llama_tok_dir), blend_ratio=0.3)
    params = SamplingParams(max_tokens=10, temperature=0)
    warm = [prompt("Notes:\n", [0, 1, 2], "Q?"), prompt("More notes:\n", [2, 1, 0], "Q!")]
    asked = prompt("Read the notes.\n", [1, 2, 0], "\nWhat flows through Norwich?")
    for segments in warm:
        reference.generate({"segments": segments}, params)
    expected = reference.generate({"segments": asked}, params)[0]
    assert expected.num_reused_segment_tokens > 0
    with serve(llm) as server:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for segments in warm:
            api.completions.create(
                model="tiny", prompt="", max_tokens=10, temperature=0,
                extra_body={"segments": segments, "prompt": None},
            )  # fmt: skip
        whole = api.completions.create(
            model="tiny", prompt="", max_tokens=10, temperature=0,
            extra_body={"segments": asked, "prompt": None},
        )  # fmt: skip
        assert whole.choices[0].text == expected.text
        assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
        details = whole.usage.prompt_tokens_details.model_dump()
        assert details["reused_segment_tokens"] == expected.num_reused_segment_tokens
        chunks = api.completions.create(
            model="tiny", prompt="", max_tokens=10, temperature=0, stream=True,
            extra_body={"segments": asked, "prompt": None, "blend_ratio": 0.3},
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "kvcache_reused_segment_tokens_total" in metrics
        assert "kvcache_segment_hit_rate" in metrics
        for body, field in (
            ({"segments": []}, "segments is empty"),
            ({"segments": ["a", ""]}, "segment 1 is empty"),
            ({"segments": ["a", "b"], "prompt": "c"}, "prompt is required (or segments"),
            ({"segments": ["a", "b"], "blend_ratio": 3}, "blend_ratio"),
            ({"prompt": "a", "blend_ratio": 0.5}, "applies to a prompt given as segments"),
            ({"segments": ["a", "\ud800"]}, "surrogate"),
        ):
            answer = httpx.post(  # ASCII JSON: a lone surrogate travels escaped
                f"{server.url}/v1/completions",
                content=json.dumps({"model": "tiny", "max_tokens": 2, **body}),
                headers={"content-type": "application/json"},
            )
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert field in error["message"], answer.text
            assert error["param"] in ("segments", "blend_ratio", "prompt"), answer.text
        llm.check_integrity()
