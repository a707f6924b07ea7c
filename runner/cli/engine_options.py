"""The engine's options on the command line: one decorator adds them to a click command, which
then receives them as one dict of EngineConfig's keyword arguments, checked before the model
loads (a wrong value costs nothing yet)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import click

from kvcache.eviction import POLICIES as EVICTION_POLICIES
from runner.cli.common_options import Option, apply_options, shown_option
from runner.cli.sizes import ByteSize, HumanInt
from runner.engine.config import (
    CPU_WEIGHT_DTYPES,
    DEFAULT_BLEND_RATIO,
    DTYPE_ALIASES,
    FP8_KV_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    EngineConfig,
)
from runner.engine.executor.multiproc import serve_rank_from_environment
from runner.engine.step.policies.registry import POLICIES as SCHEDULING_POLICIES


def _non_empty_key(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """--cache-key as given, refusing an empty one: `--cache-key "$SECRET"` with SECRET unset
    would otherwise run unsigned, trusting every stored block, without a word."""
    if value == "":
        raise click.BadParameter(
            "is empty (an unset variable?): stored blocks would go unsigned and unchecked; "
            "give the key, or leave the option out",
            param_hint="--cache-key",
        )
    return value


_OPTIONS: list[Option] = [
    shown_option("--block-size", int, 16),
    click.option("--no-prefix-cache", is_flag=True, help="Turn the prefix cache off."),
    click.option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        default=None,
        help="vLLM's names: the prefix cache on (the default) or off.",
    ),
    shown_option(
        "--eviction-policy",
        click.Choice(sorted(EVICTION_POLICIES)),
        "lru",
        "Which cached block goes first when the KV pool runs short: the least recently "
        "used, the least often used (ties: least recently), or the lowest request priority "
        "(ties: least recently; a request's priority is the Python API's priority=).",
    ),
    shown_option("--batching", click.Choice(list(SCHEDULING_POLICIES)), "continuous"),
    click.option(
        "--max-num-batched-tokens",
        type=HumanInt(),
        default=None,
        help="Tokens one step may compute [default: 512 on the CPU, 2048 on a GPU].",
    ),
    shown_option(
        "--max-num-seqs", int, 64, "Sequences one step may run (samples and beams count one each)."
    ),
    click.option(
        "--max-model-len",
        type=HumanInt(),
        default=None,
        help="Longest prompt plus answer, as vLLM reads it (2048, 1k = 1000, 1K = 1024) "
        "[default: the model's context].",
    ),
    click.option(
        "--enable-chunked-prefill/--no-enable-chunked-prefill",
        default=None,
        help="vLLM's names: a long prompt's prefill split over steps beside running answers "
        "(on by default).",
    ),
    click.option("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks."),
    shown_option("--device", None, "cpu", "cpu, cuda or cuda:N."),
    shown_option(
        "--dtype",
        click.Choice(["auto", *MODEL_DTYPES, *DTYPE_ALIASES]),
        "auto",
        "The weights' dtype; auto: float32 on the CPU, bfloat16 on a GPU (vLLM's half "
        "and float mean float16 and float32).",
    ),
    click.option(
        "--gpu-memory-utilization",
        type=float,
        default=None,  # unset unless given: the engine warns when it is given for the CPU
        help="GPU: the share of the device's memory that the weights, activations and KV pool "
        "may take; the pool gets what the others leave [default: 0.9].",
    ),
    click.option(
        "--enforce-eager",
        is_flag=True,
        help="GPU: run every step eagerly, without CUDA graphs (a faster start, slower steps).",
    ),
    click.option(
        "--async-scheduling/--no-async-scheduling",
        default=None,
        help="Schedule and prepare each step while the device runs the one before (vLLM's "
        "name); default: on for CUDA, off on the CPU. Never with --speculative-tokens.",
    ),
    shown_option(
        ("--tensor-parallel-size", "-tp"),
        int,
        1,
        "Split the model's heads, MLP and vocabulary over N ranks, each a process joined "
        "by torch.distributed (gloo on the CPU, NCCL on CUDA; docs/PARALLEL.md).",
    ),
    click.option(
        "--distributed-init-method",
        default=None,
        help="With --tensor-parallel-size: where the ranks meet, tcp://host:port (default: a "
        "free loopback port; torchrun's environment wins).",
    ),
    shown_option(
        "--speculative-tokens",
        int,
        0,
        "Requests check up to K guessed tokens each step (what an earlier request with "
        "the same prefix went on with, or n-gram lookup in their own text): faster answers that "
        "repeat earlier text, the same tokens.",
    ),
    shown_option(
        "--blend-ratio",
        click.FloatRange(0.0, 1.0),
        DEFAULT_BLEND_RATIO,
        "Prompts given as segments: the fraction of the reused segments' tokens "
        "recomputed with the full context; 1 recomputes all (the plain engine's output), 0 "
        "reuses segments as they are (docs/SEGMENTS.md).",
    ),
    click.option(
        "--deterministic",
        is_flag=True,
        help="CPU: a request's tokens and log-probabilities are bitwise the same whatever else "
        "runs beside it, however its prompt is chunked or cached; unseeded sampled requests "
        "take a seed from the engine's and their prompt (docs/DETERMINISM.md).",
    ),
    shown_option(
        "--cpu-weight-dtype",
        click.Choice(CPU_WEIGHT_DTYPES),
        "float32",
        "CPU: store weight matrices as bfloat16 or int8 (a half or a quarter of the bytes a "
        "decode step reads; the float32 model with its weights rounded so); bfloat16-dot also "
        "rounds each product's inputs to bfloat16 (AVX512-BF16); int8-dot quantizes weights "
        "and each product's inputs to int8 (AVX512-VNNI: about 3x float32 per product from 16 "
        "rows, perplexity +3.9%; docs/BENCHMARKS.md).",
    ),
    shown_option(
        "--kv-cache-dtype",
        click.Choice([*KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES]),
        "auto",
        "float16: CPU, keys and values in half the bytes of a float32 model's (twice the "
        "tokens in the pool, half the bytes a decode step reads for its contexts). vLLM's fp8 "
        "names are refused with why: there is no 8-bit KV cache here.",
    ),
    click.option(
        "--host-cache-bytes",
        type=ByteSize(),
        default=None,
        help="Keep blocks evicted from the KV pool in this much host memory (e.g. 2GiB).",
    ),
    click.option(
        "--disk-cache",
        "disk_cache_dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Write cached blocks to this directory; a later run pointed at it gets hits.",
    ),
    shown_option(
        "--disk-cache-bytes", ByteSize(), "10GiB", "The most the disk cache may take on disk."
    ),
    click.option(
        "--remote-cache",
        "remote_cache_url",
        default=None,
        help="Share cached blocks with every engine pointed at this Redis: redis://host:port/db.",
    ),
    shown_option(
        "--cache-chunk-tokens",
        int,
        256,
        "Tokens of consecutive blocks the disk and remote caches store as one value (a "
        "multiple of --block-size; engines sharing a cache should agree on it).",
    ),
    click.option(
        "--cache-key",
        default=None,
        callback=_non_empty_key,
        help="Sign every stored block with this key, and serve none that another key (or none) "
        "signed [default: $KVCACHE_CACHE_KEY]. Without a key, cache files and tiers are trusted; "
        "an empty key is an error.",
    ),
    click.option(
        "--kv-events-config",
        default=None,
        help='vLLM\'s KV events, as its JSON: \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' publishes every block stored '
        "in or removed from the KV pool (medium GPU), the host tier (CPU) and the disk tier "
        "(DISK) on a ZeroMQ PUB socket, for llm-d, Dynamo or `kvcache router --kv-events`.",
    ),
]


# Options whose flag is not their keyword's name.
_FLAGS = {"remote_cache_url": "--remote-cache", "disk_cache_dir": "--disk-cache"}


def engine_config_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """The options' values as EngineConfig's keyword arguments, checked by EngineConfig itself;
    a bad one is a usage error naming the option."""
    kwargs = dict(values)
    enable, off = kwargs.pop("enable_prefix_caching", None), kwargs.pop("no_prefix_cache")
    if enable and off:
        raise click.BadParameter(
            "contradicts --no-prefix-cache", param_hint="--enable-prefix-caching"
        )
    kwargs["enable_prefix_caching"] = not off if enable is None else enable
    for name in ("gpu_memory_utilization", "enable_chunked_prefill"):
        if kwargs.get(name) is None:
            kwargs.pop(name, None)  # EngineConfig's default
    if kwargs.get("dtype") in DTYPE_ALIASES:
        kwargs["dtype"] = DTYPE_ALIASES[kwargs["dtype"]]
    try:
        EngineConfig(**kwargs)
    except ValueError as err:
        option = next((name for name in kwargs if str(err).startswith(name)), None)
        hint = _FLAGS.get(option, f"--{option.replace('_', '-')}") if option else None
        raise click.BadParameter(str(err), param_hint=hint) from err
    return kwargs


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the engine's options to `command`, which receives them as `engine_options`: a dict
    of EngineConfig's keyword arguments, already checked. Put it below every other option
    decorator: its options come last in --help."""

    own = set(inspect.signature(command).parameters)  # the rest of kwargs are these options

    @functools.wraps(command)
    def with_engine_options(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in list(kwargs) if name not in own}
        options = engine_config_kwargs(values)
        # Under torchrun, a rank other than 0 serves its share of the model and exits: only
        # rank 0 runs the command (docs/PARALLEL.md).
        if serve_rank_from_environment(EngineConfig(**options)):
            raise SystemExit(0)
        return command(engine_options=options, **kwargs)

    return apply_options(_OPTIONS)(with_engine_options)
