"""What a load costs at start-up: building the model on the meta device imports no compiler,
the tokenizer reuses the config already read, and the fingerprint keeps hashing the files'
bytes (so prefix-cache namespaces stay what they were)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from torch import nn

from runner.model.loader import (
    SkipMetaInit,
    fingerprint,
    load_tokenizer,
    read_config,
    weight_files,
)

REPO = Path(__file__).resolve().parents[2]


def test_loading_imports_no_compiler(tiny_llama_dir: Path) -> None:
    """nn.Embedding's normal_ on the meta device used to import torch._dynamo (~0.6 s). Some
    transformers releases (5.17) import it themselves with the parts the loader takes from
    them (configs, tokenizers, RoPE tables): there is nothing of ours to check then."""
    code = (
        "import sys\n"
        "from transformers import AutoConfig, AutoTokenizer\n"
        "from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS\n"
        "if 'torch._dynamo' in sys.modules:\n"
        "    print('transformers')\n"
        "    sys.exit()\n"
        "from runner.model.loader import load_model\n"
        "load_model(sys.argv[1])\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    if out.stdout.strip() == "transformers":
        pytest.skip("this transformers release imports torch._dynamo on its own")
    assert out.stdout.strip() == "False", out.stderr


def test_skip_meta_init_skips_only_meta_random_fills() -> None:
    with SkipMetaInit(), torch.device("meta"):
        emb, lin = nn.Embedding(10, 4), nn.Linear(4, 3)
    assert emb.weight.is_meta and lin.weight.is_meta and lin.bias is not None
    assert emb.weight.shape == (10, 4) and lin.weight.shape == (3, 4)
    with SkipMetaInit():
        drawn = nn.init.normal_(torch.zeros(64))
        uniform = torch.zeros(64).uniform_(1.0, 2.0)
        meta = torch.empty(5, device="meta")
        assert meta.normal_() is meta and nn.init.kaiming_uniform_(meta.view(1, 5)).is_meta
    assert drawn.abs().sum() > 0  # real tensors are still drawn
    assert bool(((uniform >= 1.0) & (uniform < 2.0)).all())


def test_tokenizer_with_the_read_config_is_the_same(tiny_llama_tok_dir: Path) -> None:
    folder = tiny_llama_tok_dir.resolve()
    plain = load_tokenizer(folder)
    reused = load_tokenizer(folder, read_config(folder))
    assert plain is not None and reused is not None
    assert type(plain) is type(reused)
    text = "hé! the cache <|user|>"
    assert plain(text).input_ids == reused(text).input_ids
    assert plain.all_special_tokens == reused.all_special_tokens
    assert plain.chat_template == reused.chat_template
    assert plain.eos_token_id == reused.eos_token_id


def test_fingerprint_hashes_the_files_bytes(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tiny_llama_dir.resolve()
    files = weight_files(folder)
    h = xxhash.xxh3_128()
    h.update(str(folder).encode())
    h.update((folder / "config.json").read_bytes())
    for f in files:
        h.update(f"{f.name}\0".encode())
        h.update(f.read_bytes())
    assert fingerprint(folder, files) == f"{folder.name}@{h.hexdigest()[:16]}"
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    assert fingerprint(folder, [*files, empty]) != fingerprint(folder, files)
