"""vLLM's engine arguments that EngineConfig has no field for, as `LLM(...)` and `kvcache serve`
take them (vLLM's `LLM(**vars(args))` over `EngineArgs.add_cli_args` passes them all). Each is
either honoured by what this engine does anyway (accepted in silence), accepted with one warning
naming it and why it has no meaning here, or refused with a ValueError naming it where
honouring it would change results and this engine cannot. None, an argument left unset, is
always accepted in silence."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmArg:
    """One argument: the values this engine honours as it is (`same`), the values that have
    no meaning here (`ignored`, each warned about with `why`; None: any value but `same`)."""

    same: tuple[object, ...]
    why: str
    ignored: tuple[object, ...] | None = None


# Pipeline and data parallelism: a model runs on one device, or split by tensor parallelism
# (tensor_parallel_size, an engine option).
PARALLEL = ("pipeline_parallel_size", "data_parallel_size")
# Checked on their own below: the quantization a .gguf model names, and the queue's order
# (vLLM's scheduling_policy: "fcfs", continuous batching's, or "priority", batching="priority").
CHECKED_APART = ("quantization", "scheduling_policy")
VLLM_SCHEDULING_POLICIES = ("fcfs", "priority")

VLLM_ARGS: dict[str, VllmArg] = {
    "swap_space": VllmArg(
        (),
        "vLLM's CPU swap space for preempted requests; a preempted request here is "
        "recomputed, its prefix found in the cache (host_cache_bytes keeps evicted blocks in "
        "host memory)",
    ),
    "cpu_offload_gb": VllmArg(
        (0, 0.0), "the weights are held whole on the device; nothing is offloaded"
    ),
    "disable_log_stats": VllmArg((True, False), "this engine logs no periodic stats"),
    "disable_log_requests": VllmArg((True, False), "this engine logs no requests"),
    "enable_log_requests": VllmArg((False,), "this engine logs no requests"),
    "disable_custom_all_reduce": VllmArg((True, False), "one device runs the model: no all-reduce"),
    "distributed_executor_backend": VllmArg((), "one process runs the engine"),
    "max_seq_len_to_capture": VllmArg(
        (), "CUDA graphs here are captured for decode batch sizes, whatever the length"
    ),
    "tokenizer_mode": VllmArg(
        ("auto", "hf"),
        "the model's own Hugging Face tokenizer (its fast one) and chat template are used",
        ("slow", "mistral"),
    ),
    "config_format": VllmArg(
        ("auto", "hf"),
        "the model's config is read from its own files (config.json or the .gguf)",
        ("mistral",),
    ),
    "load_format": VllmArg(
        ("auto", "safetensors", "pt"),
        "the weights are read from the model's own files (safetensors, .bin or .gguf)",
        ("mistral", "gguf"),
    ),
}


def pop_vllm_args(options: dict[str, Any], model: str | None) -> dict[str, Any]:
    """`options` without vLLM's own arguments, each checked: warned about once where it has
    no meaning here, ValueError naming it where it cannot be honoured."""
    rest = dict(options)
    for name in PARALLEL:
        size = rest.pop(name, None)
        if size is not None and size != 1:
            raise ValueError(
                f"{name}={size!r}: not available; a model larger than one device runs with "
                "tensor_parallel_size (`kvcache router` spreads requests over several servers)"
            )
    quantization = rest.pop("quantization", None)
    if quantization is not None and not (
        quantization == "gguf" and str(model or "").endswith(".gguf")
    ):
        raise ValueError(
            f"quantization={quantization!r}: not available here; a .gguf model's quantized "
            "weights are loaded de-quantized, and on the CPU cpu_weight_dtype='int8' or "
            "'bfloat16' rounds the weights as they are packed"
        )
    _scheduling_policy(rest, rest.pop("scheduling_policy", None))
    for name, arg in VLLM_ARGS.items():
        value = rest.pop(name, None)
        if value is None or value in arg.same:
            continue
        if arg.ignored is not None and value not in arg.ignored:
            allowed = ", ".join(repr(v) for v in (*arg.same, *arg.ignored))
            raise ValueError(f"{name}={value!r}: must be one of {allowed}")
        log.warning("%s=%r is accepted and ignored: %s", name, value, arg.why)
    return rest


def _scheduling_policy(options: dict[str, object], policy: object) -> None:
    """vLLM's scheduling_policy as the batching it names: "priority" orders continuous
    batching's queue by priority (batching="priority"); "fcfs" leaves the batching as given.
    ValueError for another value, or beside a batching it cannot order (static, or priority
    named with "fcfs")."""
    if policy is None:
        return
    if policy not in VLLM_SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy={policy!r}: must be 'fcfs' or 'priority'")
    batching = options.get("batching")
    fits = ("continuous", "priority") if policy == "priority" else ("continuous", "static")
    if batching is not None and batching not in fits:
        raise ValueError(
            f"scheduling_policy={policy!r} and batching={batching!r} disagree: give one of them"
        )
    if policy == "priority":
        options["batching"] = "priority"


def vllm_arg_names() -> Mapping[str, VllmArg]:
    """Every name `pop_vllm_args` takes, for the command line's parsers: the parallel sizes,
    quantization and the scheduling policy (checked apart), then the table's."""
    apart = dict.fromkeys((*PARALLEL, *CHECKED_APART), VllmArg((), ""))
    return {**apart, **VLLM_ARGS}
