"""The systems `kvcache bench` knows: the engine's variants (each a set of LLM options), the
peers it measures against, and what each can be asked to do."""

from __future__ import annotations

from bench.beams import NO_BEAMS
from bench.engine_options import EngineOptions
from bench.external import EXTERNAL_SYSTEMS

ENGINE_SYSTEMS: dict[str, EngineOptions] = {
    "engine": {},
    "engine-nocache": {"enable_prefix_caching": False},
    "engine-static": {"batching": "static"},
    "engine-nochunk": {"enable_chunked_prefill": False},
    # bfloat16 / int8 weight matrices (the rounded model: it matches its own reference, not
    # hf's float32 one).
    "engine-bf16": {"cpu_weight_dtype": "bfloat16"},
    "engine-int8": {"cpu_weight_dtype": "int8"},
    # bfloat16 weights and bfloat16-rounded product inputs (AVX512-BF16 dot products).
    "engine-bf16dot": {"cpu_weight_dtype": "bfloat16-dot"},
    "engine-int8dot": {"cpu_weight_dtype": "int8-dot"},
    "engine-bf16dot-kv16": {"cpu_weight_dtype": "bfloat16-dot", "kv_cache_dtype": "float16"},
    # Keys and values stored as float16 (attention over rounded K/V: its own reference too).
    "engine-kv16": {"kv_cache_dtype": "float16"},
    # Speculative decoding by n-gram lookup (greedy requests only; the reference's output).
    "engine-spec": {"speculative_tokens": 4},
    # Batch-invariant steps (docs/DETERMINISM.md): every attention row in one fixed order.
    "engine-deterministic": {"deterministic": True},
}
PEER_SYSTEMS = ("hf-static", "hf-cb", "hf-lookup", *EXTERNAL_SYSTEMS)


def check_systems(systems: list[str], sampled: bool, beam_width: int | None) -> None:
    """ValueError naming the problem when a system is unknown or cannot run as asked (sampled,
    or searching beams): checked by `kvcache bench` before any model loads, and by run_bench."""
    unknown = [s for s in systems if s not in ENGINE_SYSTEMS and s not in PEER_SYSTEMS]
    if unknown:
        raise ValueError(
            f"unknown system(s) {', '.join(unknown)}; known: "
            + ", ".join([*ENGINE_SYSTEMS, *PEER_SYSTEMS])
        )
    if beam_width and (sampled or set(systems) & set(NO_BEAMS)):
        raise ValueError(f"beam search is greedy, and {', '.join(NO_BEAMS)} search no beams")
    if "hf-lookup" in systems and sampled:
        raise ValueError("hf-lookup (transformers' prompt lookup) is greedy only")
    if set(systems) & set(EXTERNAL_SYSTEMS) and (sampled or beam_width):
        raise ValueError(f"{', '.join(EXTERNAL_SYSTEMS)} run greedy only in the bench")
