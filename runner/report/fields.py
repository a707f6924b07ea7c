"""The fields of a metrics file that `kvcache report` reads, each checked for its type before
anything is computed: a file edited by hand, cut short or written by another tool gets one
ValueError naming the field ("requests[3].prompt_tokens must be a number, got 'ten'"), never a
KeyError, TypeError or AttributeError from deep inside a sum or a picture."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# field: (kind, required); numbers are ints or floats, never bools; "number?" may be null too.
_CACHE = (
    *("query_tokens", "hit_tokens", "readmit_query_tokens", "readmit_hit_tokens"),
    *("copied_tokens", "evicted_blocks"),
)
_TOP = ("num_preemptions", "num_draft_tokens", "num_accepted_tokens", "max_num_batched_tokens")
_REQUEST: dict[str, tuple[str, bool]] = {
    "id": ("any", True),
    "prompt_tokens": ("number", True),
    "cached_tokens": ("number", True),
    "output_tokens": ("number", True),
    "ttft_s": ("number?", False),
    "itl_s": ("numbers?", False),
    "num_preemptions": ("number", False),
    "arrival_step": ("number?", False),
    "finish_reason": ("string?", False),
    "prefix_key": ("string?", False),
    "prefix_preview": ("string?", False),
}
_STEP: dict[str, tuple[str, bool]] = {
    "step": ("number", False),
    "duration_s": ("number", False),
    "num_prefill_tokens": ("number", False),
    "num_decode_tokens": ("number", False),
    "hit_tokens_cum": ("number", True),
    "query_tokens_cum": ("number", True),
    "model_s": ("number?", False),
    "product_s": ("number?", False),
    "attention_s": ("number?", False),
}


def check_fields(metrics: Mapping[str, object], source: str) -> None:
    """Raise ValueError naming the first field of `metrics` of the wrong type (or missing,
    where the report needs it). `cache`, `requests` and `steps` are known to be a dict and
    two lists."""
    cache, requests, steps = metrics["cache"], metrics["requests"], metrics["steps"]
    assert isinstance(cache, dict) and isinstance(requests, list) and isinstance(steps, list)
    _check(source, "wall_time_s", metrics.get("wall_time_s"), "number")
    for name in _TOP:
        if name in metrics:
            _check(source, name, metrics[name], "number?")
    for name in _CACHE:
        if name in cache:
            _check(source, f"cache.{name}", cache[name], "number")
    _check_rows(source, "requests", requests, _REQUEST)
    _check_rows(source, "steps", steps, _STEP)
    for i, step in enumerate(steps):
        states = step.get("states")
        if states is None:
            continue
        where = f"steps[{i}].states"
        if not isinstance(states, dict):
            raise ValueError(f"{source}: {where} must be an object, got {_shown(states)}")
        for key, state in states.items():
            if not key.isdecimal():
                raise ValueError(f"{source}: {where} keys must be request rows, got {key!r}")
            _check(source, f"{where}.{key}", state, "string")


def _check_rows(
    source: str, name: str, rows: Sequence[object], fields: dict[str, tuple[str, bool]]
) -> None:
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{source}: {name}[{i}] must be an object, got {_shown(row)}")
        for field, (kind, required) in fields.items():
            if field in row:
                _check(source, f"{name}[{i}].{field}", row[field], kind)
            elif required:
                raise ValueError(f"{source}: {name}[{i}] has no {field!r}")


def _check(source: str, where: str, value: object, kind: str) -> None:
    if value is None and kind.endswith("?"):
        return
    kind = kind.rstrip("?")
    if kind == "any":
        ok = True
    elif kind == "number":
        ok = _is_number(value)
    elif kind == "numbers":
        ok = isinstance(value, list) and all(_is_number(v) for v in value)
        kind = "a list of numbers"
    else:
        ok = isinstance(value, str)
    if not ok:
        article = "" if kind.startswith("a ") else "a "
        shown = "nothing" if value is None else _shown(value)
        raise ValueError(f"{source}: {where} must be {article}{kind}, got {shown}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"
