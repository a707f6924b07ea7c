"""vLLM's module paths and helpers (issue 49, item 2): scripts in the shape of vLLM's own
examples run with only the import, the model and the arguments changed. generate.py and
chat.py build the LLM from `EngineArgs.add_cli_args` on a `FlexibleArgumentParser` and set
fields on `llm.get_default_sampling_params()`; prefix_caching.py compares two engines with
`cleanup_dist_env_and_memory` between them and `SamplingParams.clone`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache import EngineArgs, SamplingParams
from kvcache.utils import FlexibleArgumentParser, human_readable_int

# generate.py's shape: the engine's flags and the script's own, LLM(**vars(args)).
GENERATE = """
from kvcache import LLM, EngineArgs
from kvcache.utils import FlexibleArgumentParser


def create_parser():
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="MODEL")
    group = parser.add_argument_group("Sampling parameters")
    group.add_argument("--max-tokens", type=int)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    return parser


def main(args: dict):
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    top_p = args.pop("top_p")
    top_k = args.pop("top_k")
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k
    outputs = llm.generate(["Hello, my name is", "The capital of France is"], sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    print("CONFIG", llm.config.max_model_len, llm.config.enable_prefix_caching,
          llm.config.dtype, sampling_params.max_tokens)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
"""

# chat.py's shape: the engine's flags on an argument group, the chat call.
CHAT = """
from kvcache import LLM, EngineArgs
from kvcache.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
engine_group = parser.add_argument_group("Engine arguments")
EngineArgs.add_cli_args(engine_group)
engine_group.set_defaults(model="MODEL")
parser.add_argument("--max-tokens", type=int)
parser.add_argument("--chat-template-path", type=str)
args = vars(parser.parse_args())
max_tokens = args.pop("max_tokens")
args.pop("chat_template_path")
llm = LLM(**args)
sampling_params = llm.get_default_sampling_params()
sampling_params.max_tokens = max_tokens
sampling_params.temperature = 0
outputs = llm.chat([{"role": "user", "content": "Hello"}], sampling_params, use_tqdm=False)
print("CHAT", len(outputs[0].outputs[0].token_ids))
"""

# prefix_caching.py's shape: one engine without the prefix cache, freed, one with it.
PREFIX_CACHING = """
from kvcache import LLM, SamplingParams
from kvcache.distributed import cleanup_dist_env_and_memory

prefix = "You are an expert school principal, skilled in effectively managing faculty. " * 2
prompts = [prefix + q for q in ["Hello, my name is", "The capital of France is"]]
sampling_params = SamplingParams(temperature=0.0)
regular_llm = LLM(model="MODEL", num_kv_blocks=64)
regular = [o.outputs[0].text for o in regular_llm.generate(prompts, sampling_params)]
del regular_llm
cleanup_dist_env_and_memory()
prefix_cached_llm = LLM(model="MODEL", enable_prefix_caching=True, num_kv_blocks=64)
prefix_cached_llm.generate(prompts[0], sampling_params)
cached = [o.outputs[0].text for o in prefix_cached_llm.generate(prompts, sampling_params)]
print("SAME", regular == cached)
"""


def run_script(tmp_path: Path, text: str, model: Path, *argv: str) -> str:
    script = tmp_path / "example.py"
    script.write_text(text.replace("MODEL", str(model)))
    done = subprocess.run(
        [sys.executable, str(script), *argv], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_generate_py_shape(tiny_llama_tok_dir: Path, tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        GENERATE,
        tiny_llama_tok_dir,
        "--max-model-len",
        "0.2k",
        "--no-enable-prefix-caching",
        "--dtype",
        "float",
        "--max_tokens",  # FlexibleArgumentParser: underscores as dashes
        "5",
        "--temperature",
        "0",
        "--num-kv-blocks",
        "32",
    )
    assert out.count("Generated text:") == 2
    assert "CONFIG 200 False float32 5" in out


def test_chat_py_shape(tiny_llama_tok_dir: Path, tmp_path: Path) -> None:
    out = run_script(tmp_path, CHAT, tiny_llama_tok_dir, "--max-tokens", "4", "-tp", "1")
    assert "CHAT 4" in out


def test_prefix_caching_py_shape(tiny_llama_tok_dir: Path, tmp_path: Path) -> None:
    assert "SAME True" in run_script(tmp_path, PREFIX_CACHING, tiny_llama_tok_dir)


def test_module_paths() -> None:
    from kvcache.inputs import TextPrompt, TokensPrompt
    from kvcache.outputs import CompletionOutput, RequestOutput
    from kvcache.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

    assert SamplingParams is __import__("kvcache").SamplingParams
    assert all((TextPrompt, TokensPrompt, CompletionOutput, RequestOutput, BeamSearchParams))
    assert StructuredOutputsParams is not None
    from kvcache import sampling_params

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        sampling_params.Nope  # noqa: B018


def test_clone_is_deep() -> None:
    params = SamplingParams(max_tokens=7, stop=["a"], logit_bias={3: 1.0})
    copy = params.clone()
    copy.max_tokens = 9
    copy.stop.append("b")  # type: ignore[union-attr]
    assert params.max_tokens == 7 and params.stop == ["a"] and copy.logit_bias == {3: 1.0}


def test_engine_args_from_cli_args_and_sizes() -> None:
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--other", type=int, default=1)
    args = parser.parse_args(["--model", "m", "--max_model_len", "1K", "--swap-space", "4"])
    engine = EngineArgs.from_cli_args(args)
    assert engine.kwargs() == {"model": "m", "max_model_len": 1024, "swap_space": 4.0}
    assert vars(parser.parse_args([])) == {"model": None, "other": 1}  # nothing else unless given
    assert human_readable_int("1k") == 1000 and human_readable_int("25.6k") == 25600
    with pytest.raises(argparse.ArgumentTypeError, match="whole number"):
        human_readable_int("1.5K")
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("lots")
