"""vLLM's Python API on this engine (issue 40, item 1): a vLLM user's script runs unchanged,
with vLLM's argument names, prompt dicts, chat keywords, output fields and logprob shape, and
a Hub id found in the local Hugging Face cache."""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache import LLM, SamplingParams
from runner.engine.requests.outputs import Logprob, PositionLogprobs
from runner.model.loader import resolve_model_dir
from tests.conftest import CHAT_TEMPLATE, load_hf_reference

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
HUB_ID = "tiny-org/tiny-llama"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is"]

# A vLLM example script as a vLLM user writes it; only the import line differs
# (`from vllm import LLM, SamplingParams, TextPrompt, TokensPrompt`).
VLLM_SCRIPT = """
from kvcache import LLM, SamplingParams, TextPrompt, TokensPrompt

prompts = ["Hello, my name is", "The capital of France is"]
sampling_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
llm = LLM(model="tiny-org/tiny-llama", tokenizer="tiny-org/tiny-llama", dtype="float32",
          seed=0, max_model_len=256,
          gpu_memory_utilization=0.5, enable_prefix_caching=True, max_num_seqs=8,
          block_size=16, enforce_eager=True, trust_remote_code=False)
outputs = llm.generate(prompts, sampling_params)
texts = []
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    texts.append(generated_text)

tokenizer = llm.get_tokenizer()
ids = tokenizer.encode(prompts[0])
by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), sampling_params=sampling_params)
mixed = llm.generate([TextPrompt(prompt=prompts[0]), prompts[1]], sampling_params)

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
]
chat_outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False)

sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
scored = llm.generate(prompts[:1], sp)[0]
logprob_rows = []
for position in scored.outputs[0].logprobs:
    for token_id, lp in position.items():
        logprob_rows.append((token_id, lp.logprob, lp.rank, lp.decoded_token))
cumulative = scored.outputs[0].cumulative_logprob
finished = [o.finished for o in outputs]
reset = llm.reset_prefix_cache()
"""


def hub_cache_with(model_dir: Path, cache: Path, repo_id: str = HUB_ID) -> Path:
    """Lay `model_dir` out in a Hugging Face cache as huggingface_hub does:
    models--org--name/snapshots/<commit>/... and refs/main naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / SNAPSHOT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snapshot


@pytest.fixture
def hub_cache(tiny_llama_tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache holding the tiny Llama as HUB_ID, named by HF_HUB_CACHE, offline."""
    cache = tmp_path / "hf-cache"
    hub_cache_with(tiny_llama_tok_dir, cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture(scope="module")
def llm(tiny_llama_tok_dir: Path) -> LLM:
    return LLM(str(tiny_llama_tok_dir))


# ------------------------------------------------------------------------------ the script
def test_a_vllm_script_runs_unchanged(
    hub_cache: Path, tiny_llama_tok_dir: Path, tmp_path: Path
) -> None:
    """The script runs as written, and its greedy answers equal our own API's."""
    script = tmp_path / "vllm_example.py"
    script.write_text(VLLM_SCRIPT)
    done: dict[str, Any] = runpy.run_path(str(script))
    ours = LLM(str(tiny_llama_tok_dir))
    want = ours.generate(PROMPTS, GREEDY)
    assert done["texts"] == [o.text for o in want]
    assert [o.token_ids for o in done["by_ids"]] == [want[0].token_ids]
    assert [o.token_ids for o in done["mixed"]] == [o.token_ids for o in want]
    chat_want = ours.chat([done["conversation"]], GREEDY)[0]
    assert done["chat_outputs"][0].token_ids == chat_want.token_ids
    assert done["finished"] == [True, True] and done["reset"] is True
    rows = done["logprob_rows"]
    assert rows and all(lp <= 0 and rank >= 1 and isinstance(t, str) for _, lp, rank, t in rows)
    assert done["cumulative"] == pytest.approx(
        sum(p.logprob for p in ours.generate(PROMPTS[:1], done["sp"])[0].logprobs or [])
    )


# ------------------------------------------------------------------------------ Hub ids
def test_a_hub_id_is_found_in_hf_hub_cache(hub_cache: Path) -> None:
    assert (
        resolve_model_dir(HUB_ID)
        == hub_cache / f"models--tiny-org--tiny-llama/snapshots/{SNAPSHOT}"
    )


def test_a_hub_id_is_found_under_hf_home(
    tiny_llama_tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "hf-home"
    snapshot = hub_cache_with(tiny_llama_tok_dir, home / "hub")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_dir(HUB_ID) == snapshot


def test_a_hub_id_not_cached_offline_is_refused_by_name(hub_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"'tiny-org/absent-model'.*HF_HUB_OFFLINE"):
        LLM("tiny-org/absent-model")


def test_a_path_that_is_no_hub_id_keeps_its_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model path not found: .*missing"):
        resolve_model_dir(str(tmp_path / "missing"))


# ------------------------------------------------------------------------------ generate
def test_sampling_params_by_either_name_and_one_per_prompt(llm: LLM) -> None:
    want = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in llm.generate(PROMPTS, sampling_params=GREEDY)] == [
        o.token_ids for o in want
    ]
    assert [o.token_ids for o in llm.generate(PROMPTS, params=GREEDY)] == [
        o.token_ids for o in want
    ]
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    each = llm.generate(PROMPTS, sampling_params=[GREEDY, short])
    assert [len(o.token_ids) for o in each] == [8, 3]
    with pytest.raises(ValueError, match="sampling_params or params"):
        llm.generate(PROMPTS, sampling_params=GREEDY, params=GREEDY)


def test_prompt_dicts_alone_and_mixed(llm: LLM) -> None:
    ids = llm.get_tokenizer()(PROMPTS[1]).input_ids
    want = llm.generate(PROMPTS, GREEDY)
    mixed = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], GREEDY)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in want]
    assert mixed[0].prompt == PROMPTS[0] and mixed[1].prompt is None
    assert mixed[1].prompt_token_ids == ids
    alone = llm.generate({"prompt": PROMPTS[1]}, GREEDY)
    assert [o.token_ids for o in alone] == [want[1].token_ids]
    plain = llm.generate([PROMPTS[0], {"prompt_token_ids": ids}, ids], GREEDY)
    assert [o.token_ids for o in plain] == [want[0].token_ids] + [want[1].token_ids] * 2


def test_a_prompt_dicts_cache_salt_keeps_its_blocks_apart(llm: LLM) -> None:
    prompt = "x" * 40  # 40 byte tokens: two full blocks
    llm.generate(prompt, GREEDY)
    warm, salted = llm.generate([prompt, {"prompt": prompt, "cache_salt": "tenant-b"}], GREEDY)
    assert warm.num_cached_tokens >= 32 and salted.num_cached_tokens == 0
    assert warm.token_ids == salted.token_ids


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ({"prompt": "hi", "multi_modal_data": {}}, "multi_modal_data are not supported"),
        ({"cache_salt": "a"}, "needs 'prompt'"),
        ({"prompt": 5}, "'prompt' must be text"),
        ({"prompt_token_ids": "5 6"}, "prompt_token_ids must be a list"),
        ({"prompt": "hi", "cache_salt": 3}, "cache_salt must be a string"),
    ],
)
def test_bad_prompt_dicts_are_refused_by_name(
    llm: LLM, prompt: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match=f"prompt 1: .*{problem}"):
        llm.generate(["fine", prompt], GREEDY)
    assert not llm.has_unfinished()


# ------------------------------------------------------------------------------ chat
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    "</tools>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if not (continue_final_message and loop.last) %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def prompt_text(llm: LLM, out: Any) -> str:
    return str(llm.get_tokenizer().decode(out.prompt_token_ids))


def test_chat_keywords_reach_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "weather?"}]
    out = llm.chat(messages, GREEDY, chat_template=TOOLS_TEMPLATE, tools=[WEATHER])[0]
    assert prompt_text(llm, out) == "<tools>get_weather;</tools><|user|>weather?</s><|assistant|>"
    bare = llm.chat(messages, GREEDY, add_generation_prompt=False)[0]
    assert prompt_text(llm, bare) == "<|user|>weather?</s>"
    assert (
        llm.chat(messages, sampling_params=GREEDY)[0].token_ids
        == llm.chat([messages], params=GREEDY)[0].token_ids
    )


def test_continue_final_message_leaves_the_answer_open(llm: LLM) -> None:
    messages = [
        {"role": "user", "content": "Name a city"},
        {"role": "assistant", "content": "It is Par"},
    ]
    out = llm.chat(
        messages,
        GREEDY,
        chat_template=TOOLS_TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert prompt_text(llm, out) == "<|user|>Name a city</s><|assistant|>It is Par"
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(messages, GREEDY, continue_final_message=True)


def test_a_chat_template_given_where_the_model_has_none(tiny_llama_tok_dir: Path) -> None:
    engine = LLM(str(tiny_llama_tok_dir))
    engine.tokenizer.chat_template = None
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        engine.chat(messages, GREEDY)
    out = engine.chat(messages, GREEDY, chat_template=CHAT_TEMPLATE)[0]
    assert prompt_text(engine, out) == "<|user|>hi</s><|assistant|>"


# ------------------------------------------------------------------------------ outputs
def test_finished_and_stop_reason(llm: LLM) -> None:
    free = llm.generate(PROMPTS[0], GREEDY)[0]
    assert free.finished and free.outputs[0].finished()
    assert free.finish_reason == "length" and free.outputs[0].stop_reason is None
    # The greedy answer's second token as a stop token, then its text as a stop string.
    token = free.token_ids[1]
    by_token = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[token], ignore_eos=True),
    )[0]
    assert by_token.finish_reason == "stop" and by_token.outputs[0].stop_reason == token
    stop = llm.get_tokenizer().decode(free.token_ids[2:4])
    by_text = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, stop=["zzz", stop], ignore_eos=True)
    )[0]
    assert by_text.outputs[0].stop_reason == stop and by_text.stop_reason == stop
    eos = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, allowed_token_ids=[2]))[0]
    assert eos.token_ids == [2] and eos.finish_reason == "stop"
    assert eos.outputs[0].stop_reason is None  # EOS names no stop reason, as in vLLM


def test_logprobs_in_vllms_shape(llm: LLM, tiny_llama_tok_dir: Path) -> None:
    hf = load_hf_reference(tiny_llama_tok_dir)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer(PROMPTS[0]).input_ids
    params = SamplingParams(max_tokens=6, temperature=1.5, seed=4, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    sample = out.outputs[0]
    assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
    for step, (token, position) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        row = reference[len(prompt) - 1 + step]
        assert isinstance(position, dict) and isinstance(position, PositionLogprobs)
        assert token in position and len(position) in (3, 4)  # the token and the top 3
        for token_id, entry in position.items():
            assert isinstance(entry, Logprob)
            assert entry.logprob == pytest.approx(float(row[token_id]), abs=1e-4)
            assert entry.decoded_token == tokenizer.decode([token_id])
            # Its rank in the whole distribution (1 = likeliest), up to float noise.
            assert entry.rank is not None
            assert int((row > row[token_id] + 1e-4).sum()) + 1 <= entry.rank
            assert entry.rank <= int((row >= row[token_id] - 1e-4).sum())
        assert [position[t].rank for t, _ in position.top] == [1, 2, 3]
        assert position.logprob == position[token].logprob  # ours, as TokenLogprobs had it
    assert sample.cumulative_logprob == pytest.approx(
        sum(float(reference[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids)),
        abs=1e-3,
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for position_in_prompt, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and prompt[position_in_prompt] in entry
    assert sample.token_logprobs is not None  # the same figures as TokenLogprobs, for ours
    assert [t.logprob for t in sample.token_logprobs] == [p.logprob for p in sample.logprobs]


def test_greedy_tokens_rank_first(llm: LLM) -> None:
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, logprobs=0))[0]
    assert out.logprobs is not None
    assert [dict(p) for p in out.logprobs] == [
        {t: Logprob(p.logprob, 1, llm.get_tokenizer().decode([t]))}
        for t, p in zip(out.token_ids, out.logprobs, strict=True)
    ]


# ------------------------------------------------------------------------------ the engine
class TreeMirror:
    """A block listener (as KV events are) that keeps the set of blocks it was told are in
    the tree."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def blocks_stored(self, nodes: list[Any]) -> None:
        self.held.update(node.block_id for node in nodes)

    def blocks_removed(self, nodes: list[Any]) -> None:
        self.held.difference_update(node.block_id for node in nodes)


def test_reset_prefix_cache(tiny_llama_tok_dir: Path) -> None:
    engine = LLM(str(tiny_llama_tok_dir), block_size=4, num_kv_blocks=128)
    mirror = TreeMirror()
    engine.block_manager.add_listener(mirror)
    prompt = list(range(10, 40))
    engine.generate([prompt], GREEDY)
    assert engine.generate([prompt], GREEDY)[0].num_cached_tokens > 0
    assert mirror.held
    assert engine.reset_prefix_cache() is True
    assert mirror.held == set()  # listeners (KV events) heard every block go
    assert engine.stats()["blocks_cached"] == 0 and engine.stats()["blocks_tails"] == 0
    assert engine.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    # A running request keeps its blocks: the rest is dropped, and False says not all went.
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request(prompt, long, request_id="running")
    engine.step()
    other = list(range(50, 80))
    engine.generate([other], GREEDY)
    assert engine.reset_prefix_cache() is False
    engine.block_manager.check_integrity()
    assert engine.generate([other], GREEDY)[0].num_cached_tokens == 0
    engine.run_until_done()
    assert engine.reset_prefix_cache() is True


def test_get_tokenizer_and_beam_search_take_vllms_forms(llm: LLM) -> None:
    from runner.engine.api.beam_search import BeamSearchParams

    assert llm.get_tokenizer() is llm.tokenizer
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    (by_dict,) = llm.beam_search([{"prompt_token_ids": ids}], params)
    (by_text,) = llm.beam_search([PROMPTS[0]], params)
    best = by_dict.sequences[0]
    assert best.token_ids == by_text.sequences[0].token_ids
    assert best.tokens == ids + best.token_ids and best.cum_logprob == best.cumulative_logprob


def test_unknown_constructor_names_stay_errors(tiny_llama_tok_dir: Path) -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(str(tiny_llama_tok_dir), no_such_option=1)


def test_vllms_constructor_names(
    tiny_llama_tok_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """tokenizer may name the model (another is refused by name); gpu_memory_utilization on
    the CPU is accepted with a warning that says it changes nothing there."""
    with caplog.at_level("WARNING", logger="runner.engine.api.llm"):
        engine = LLM(
            str(tiny_llama_tok_dir), tokenizer=str(tiny_llama_tok_dir), gpu_memory_utilization=0.5
        )
    assert "gpu_memory_utilization" in caplog.text and engine.get_tokenizer() is not None
    with pytest.raises(ValueError, match="tokenizer=.*only the model's own tokenizer"):
        LLM(str(tiny_llama_tok_dir), tokenizer=str(tmp_path))
