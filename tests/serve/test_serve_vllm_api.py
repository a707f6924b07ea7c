"""`kvcache serve` as vLLM's server, through the official openai client and plain HTTP: fields
it does not know are ignored with one warning each (the openai client's `store`), structured
outputs old and new, `echo`, `prompt_logprobs`, the chat template's options, /tokenize and
/detokenize, /version and /ping, and the command line with vLLM's positional MODEL and flags."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import click
import httpx
import openai
import pytest
from click.testing import CliRunner

from kvcache import LLM, SamplingParams
from runner.cli.engine_options import engine_options
from runner.serve.command import serve as serve_command
from tests.redis_server import free_port
from tests.serve.conftest import LiveServer, ServeFactory
from tests.serve.processes import serve_process, wait_until_up

PROMPT = "The cache holds blocks of sixteen tokens each, "


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_unknown_fields_are_ignored_with_one_warning_each(
    server: LiveServer, reference_llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    expected = reference_llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))
    api = client(server)
    caplog.set_level(logging.WARNING, logger="runner.serve")
    for _ in range(2):
        out = api.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"frobnicate": 1, "stream_options": None},
        )
        assert out.choices[0].text == expected[0].text  # the answer is the same
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi", "weight": 2}],  # type: ignore[misc,list-item]
        max_tokens=2,
        store=False,
        metadata={"run": "1"},
        parallel_tool_calls=True,
    )
    assert chat.choices[0].message.content is not None
    warned = [r.getMessage() for r in caplog.records if "is not known here" in r.getMessage()]
    assert sorted(warned) == sorted(
        f"the request field {name!r} is not known here and is ignored"
        for name in ("frobnicate", "store", "metadata", "messages.0.weight")
    )
    # A known field with a bad value is still a 400 naming it.
    resp = post(server, "/v1/chat/completions", {"messages": [], "store": False})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_structured_outputs_old_and_new(server: LiveServer, endpoint: str) -> None:
    api = client(server)
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
    }
    word = {"enum": ["yes", "no"]}  # a schema with no room for whitespace
    compact = {"json": schema, "disable_any_whitespace": True}
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"guided_json": word}, lambda t: json.loads(t) in ("yes", "no")),
        ({"guided_grammar": 'root ::= "up" | "down"'}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"choice": ["cat", "dog"]}}, lambda t: t in ("cat", "dog")),
        ({"structured_outputs": {"regex": "[a-c]{4}"}}, lambda t: re.fullmatch("[a-c]{4}", t)),
        ({"structured_outputs": {"json": word}}, lambda t: json.loads(t) in ("yes", "no")),
        ({"structured_outputs": compact}, lambda t: json.loads(t)["answer"] in ("yes", "no")),
        (
            {"structured_outputs": {"grammar": 'root ::= "on" | "off"'}},
            lambda t: t in ("on", "off"),
        ),
    ]
    for extra, conforms in cases:
        if endpoint == "chat":
            out = api.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "pick"}],
                max_tokens=40,
                extra_body=extra,
            )
            text = out.choices[0].message.content or ""
        else:
            text = (
                api.completions.create(
                    model="tiny", prompt="pick: ", max_tokens=40, extra_body=extra
                )
                .choices[0]
                .text
            )
        assert conforms(text), (extra, text)


def test_echo_and_prompt_logprobs(server: LiveServer, reference_llm: LLM) -> None:
    api = client(server)
    plain = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1
    )
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    prompt_ids = reference_llm.tokenizer(PROMPT).input_ids
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids) + 6
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has none
    assert "".join(choice.logprobs.tokens or []) == choice.text
    streamed = "".join(
        c.choices[0].text
        for c in api.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == choice.text

    reference = reference_llm.generate(
        [PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    )[0]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    got = post(server, "/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt_ids)
    for position, token_id, expected in zip(
        got[1:], prompt_ids[1:], reference.prompt_logprobs[1:], strict=True
    ):
        assert position[str(token_id)]["logprob"] == pytest.approx(
            expected[token_id].logprob, abs=1e-4
        )
        assert position[str(token_id)]["decoded_token"] == reference_llm.tokenizer.decode(
            [token_id]
        )
        assert 2 <= len(position) <= 3  # the token and the two likeliest
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = post(server, "/v1/chat/completions", {**chat, "prompt_logprobs": 1}).json()
    assert answer["prompt_logprobs"][0] is None
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]


def test_chat_template_options(serve: ServeFactory, tiny_llm: LLM) -> None:
    messages = [
        {"role": "user", "content": "Say a word."},
        {"role": "assistant", "content": "Sure: ban"},
    ]
    tokenizer = tiny_llm.tokenizer
    with serve() as server:
        body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
        cont = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
        answer = post(server, "/v1/chat/completions", {**body, **cont}).json()
        open_text = tiny_llm.apply_chat_template(
            messages, {"add_generation_prompt": False, "continue_final_message": True}
        )
        assert answer["usage"]["prompt_tokens"] == len(tokenizer(open_text).input_ids)
        assert answer["choices"][0]["message"]["content"].startswith("Sure: ban")
        both = post(server, "/v1/chat/completions", {**body, "continue_final_message": True})
        assert both.status_code == 400 and "add_generation_prompt" in both.text
        own = post(server, "/v1/chat/completions", {**body, "chat_template": "{{ 'x' }}"})
        assert own.status_code == 400 and own.json()["error"]["param"] == "chat_template"
    with serve(trust_request_chat_template=True) as server:
        own = post(
            server, "/v1/chat/completions", {**body, "chat_template": "<{{ messages[0].content }}>"}
        )
        assert own.status_code == 200, own.text
        assert own.json()["usage"]["prompt_tokens"] == len(tokenizer("<Say a word.>").input_ids)


def test_tokenize_detokenize_version_and_ping(server: LiveServer, tiny_llm: LLM) -> None:
    tokenizer = tiny_llm.tokenizer
    out = post(server, "/tokenize", {"model": "tiny", "prompt": PROMPT}).json()
    assert out["tokens"] == tokenizer(PROMPT).input_ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == tiny_llm.max_model_len
    assert out["token_strs"] is None
    back = post(server, "/detokenize", {"model": "tiny", "tokens": out["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(out["tokens"])}
    assert PROMPT in back["prompt"]
    strs = post(server, "/tokenize", {"prompt": "ab", "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    text = tiny_llm.apply_chat_template(messages)
    assert chat["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    bad = post(server, "/detokenize", {"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"model": "gpt-9", "prompt": "x"}).status_code == 404
    assert post(server, "/tokenize", {}).status_code == 400
    assert httpx.get(f"{server.url}/version").json()["version"] == "0.1.0"
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    server.state.draining = True
    try:
        assert httpx.get(f"{server.url}/ping").status_code == 503
    finally:
        server.state.draining = False


def test_the_command_line_takes_vllms_names(
    tiny_llama_tok_dir: Path, tmp_path: Path, tiny_llm: LLM
) -> None:
    runner = CliRunner()
    version = runner.invoke(serve_command, ["--version"])
    assert version.exit_code == 0 and version.output.strip() == "0.1.0"
    both = runner.invoke(serve_command, ["a-model", "--model", "another"])
    assert both.exit_code == 2 and "MODEL argument" in both.output
    missing = runner.invoke(serve_command, ["m", "--chat-template", str(tmp_path / "none.jinja")])
    assert missing.exit_code == 2 and "--chat-template" in missing.output

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    port = free_port()
    command = [
        str(tiny_llama_tok_dir),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--num-kv-blocks",
        "64",
    ]
    command += ["--max-num-seqs", "8", "--max-model-len", "256", "--enable-prefix-caching"]
    command += ["--dtype", "float", "--seed", "3", "--chat-template", str(template)]
    command += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    command += ["--trust-remote-code", "--disable-log-requests"]
    proc = serve_process(command)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(proc, url, timeout_s=90)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 256)]
        body = {"messages": [{"role": "user", "content": "hi"}]}
        tokens = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
        assert tokens == tiny_llm.tokenizer("[hi]", add_special_tokens=False).input_ids
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_engine_options_take_vllms_names() -> None:
    seen: list[dict[str, Any]] = []

    @click.command()
    @engine_options
    def command(engine_options: dict[str, Any]) -> None:
        seen.append(engine_options)

    runner = CliRunner()
    for args, prefix, dtype in [
        ([], True, "auto"),
        (["--no-enable-prefix-caching", "--dtype", "half"], False, "float16"),
        (["--enable-prefix-caching", "--dtype", "float"], True, "float32"),
        (["--no-prefix-cache"], False, "auto"),
    ]:
        assert runner.invoke(command, args).exit_code == 0
        assert (seen[-1]["enable_prefix_caching"], seen[-1]["dtype"]) == (prefix, dtype)
    # Not given, --gpu-memory-utilization is left to the engine (which warns when it is given
    # on the CPU, where it sizes nothing).
    assert "gpu_memory_utilization" not in seen[0]
    assert runner.invoke(command, ["--gpu-memory-utilization", "0.5"]).exit_code == 0
    assert seen[-1]["gpu_memory_utilization"] == 0.5
    both = runner.invoke(command, ["--enable-prefix-caching", "--no-prefix-cache"])
    assert both.exit_code == 2 and "--enable-prefix-caching" in both.output


def test_a_requests_priority_reaches_the_engine(serve: ServeFactory, tiny_llm: LLM) -> None:
    """vLLM's `priority` field, on completions and chats (the openai client's extra_body),
    queues the request with that priority; one that is not an integer is a 400 naming it."""
    seen: list[int] = []
    tiny_llm.add_schedule_listener(lambda out: seen.extend(s.priority for s in out.admitted))
    with serve() as server:
        api = client(server)
        api.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"priority": 3}
        )
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"priority": -2},
        )
        api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        bad = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "priority": "high"})
    assert seen == [3, -2, 0]
    assert bad.status_code == 400 and "priority" in bad.text
