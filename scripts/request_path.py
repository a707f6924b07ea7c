"""The files one greedy request enters, in the order it first enters them: what
docs/ARCHITECTURE.md's "One request's path" lists (tests/layout/test_request_path.py checks it).

    python scripts/request_path.py            # the default model, the docs' request

`sys.setprofile` over one `LLM.generate(["The capital of France is"], max_tokens=1, greedy)`
call, after a first call on another engine (so nothing is built on first use): each project
file whose Python code runs, dataclasses' generated methods counted by their class's module.
The C sources the C layer stack runs are not seen by a profile; the docs name them by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "runner")


def project_file(frame: FrameType) -> str | None:
    """The repository path of the project file `frame` runs in, or None."""
    filename = frame.f_code.co_filename
    if filename.startswith("<"):  # a dataclass's generated method: its class's module
        module = frame.f_globals.get("__name__", "")
        spec = sys.modules.get(module)
        filename = getattr(spec, "__file__", None) or ""
    try:
        path = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(path) if path.parts and path.parts[0] in PACKAGES else None


def request_path(model: str | None = None) -> list[str]:
    """The project's Python files one cold greedy request enters, in first-entry order."""
    from kvcache import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    LLM(model).generate(["The capital of France is"], params)  # builds what is built once
    llm = LLM(model)
    entered: dict[str, None] = {}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            path = project_file(frame)
            if path is not None:
                entered.setdefault(path, None)

    sys.setprofile(profile)
    try:
        llm.generate(["The capital of France is"], params)
    finally:
        sys.setprofile(None)
    return list(entered)


if __name__ == "__main__":
    for i, path in enumerate(request_path(sys.argv[1] if len(sys.argv) > 1 else None), 1):
        print(f"{i:3d} {path}")
