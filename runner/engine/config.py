"""Engine configuration: one dataclass, validated once at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvcache.eviction import POLICIES as EVICTION_POLICIES
from kvcache.redaction import redact_url
from runner.backends.cpu.quant import CPU_WEIGHT_DTYPES
from runner.backends.registry import BACKEND_NAMES
from runner.kv_events.config import KVEventsConfig

# Default tokens per step. On the CPU a step's time grows with its tokens, and prefill runs as
# fast in chunks of 512 as of 2,048, so a prompt that arrives among running answers delays them
# ~0.8 s a step instead of ~3 s (measured with kvcache bench: docs/BENCHMARKS.md). On a GPU a step
# of 2,048 tokens costs little more than one of 512, and fewer steps mean less host work.
CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET = 512, 2048
# What a model's weights may be loaded as (None or "auto": float32 on the CPU, bfloat16 on a
# GPU).
MODEL_DTYPES = ("float32", "bfloat16", "float16")
# vLLM's (and torch's) other names for them.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# Where the engine runs: the CPU or one CUDA device (torch's spelling).
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
# The packed weights whose products deterministic=True has checked per-row (panel_gemm.c): the
# bfloat16-dot and int8-dot products round or quantize their inputs in kernels not checked.
DETERMINISTIC_WEIGHT_DTYPES = ("float32", "bfloat16", "int8")
# What the KV cache may store: the model's dtype ("auto"), or float16 (half the bytes of float32).
KV_CACHE_DTYPES = ("auto", "float16")
# Of the reused segments' tokens, the fraction recomputed by default: chosen from the blend
# bench's table of accuracy against time (docs/SEGMENTS.md).
DEFAULT_BLEND_RATIO = 0.2
# vLLM's 8-bit KV caches: refused by name (their rounding would change results; none is here).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the scheduler and model runner need to know, checked in one place.

    `num_kv_blocks` wins over `kv_cache_memory_bytes` when both are given; with neither the
    pool is sized to hold `max_num_seqs` sequences of the model's full context.
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    # The scheduling policy by name: "continuous" or "static" (runner/engine/step/policies/,
    # which checks the name when the engine is built).
    batching: str = "continuous"
    # Tokens one step may compute (decodes first, then prefill chunks); None: `token_budget`.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    # The longest prompt plus answer a request may reach; None: the model's own context
    # (max_position_embeddings). Less bounds each sequence's block table, the default KV pool
    # and, on CUDA, the decode graphs' grid (one program per 512 tokens of it a sequence).
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    attention_backend: str | None = None
    enable_chunked_prefill: bool = True
    # A waiting request older than this many steps is admitted before cache-aware reordering.
    max_wait_steps: int = 64
    enforce_eager: bool = False
    # CPU only: pack float32 weights once (runner/backends/cpu/linear.py).
    prepack_weights: bool = True
    # CPU only: the C kernels of runner/backends/cpu/csrc (products on packed weights, attention,
    # norms), built with the system compiler where they can be (runner/backends/cpu/loader.py); else
    # oneDNN products and torch's attention.
    cpu_kernels: bool = True
    # CPU only: what the packed products store their weights as. "bfloat16" halves the bytes a
    # decode step streams, "int8" (a scale per 32 weights) quarters them (the C kernels widen
    # each weight to float32 as they read it; activations, norms and the KV cache stay
    # float32): the model is then the float32 model with every weight matrix rounded so,
    # embeddings included (runner/backends/cpu/quant.py). "bfloat16-dot" stores bfloat16 weights and
    # rounds each product's input rows to bfloat16 too, summing exact products in float32
    # (twice the multiply-adds per instruction; needs AVX512-BF16 and the C kernels).
    # "int8-dot" quantizes weights per output column and each product's input rows to int8,
    # summed exactly in int32 by AVX512-VNNI (the fastest prefill where VNNI runs 2.8x
    # float32's multiply-adds; needs the C kernels; docs/BENCHMARKS.md has its quality).
    cpu_weight_dtype: str = "float32"
    # The KV cache's dtype: "auto" is the model's; "float16" stores a float32 model's keys and
    # values in half the bytes (rounded as they are stored; attention reads them widened, so
    # it is the float32 model attending to rounded K/V): twice the tokens in the same memory,
    # and half the bytes a decode step reads for its contexts. llama.cpp's default.
    kv_cache_dtype: str = "auto"
    # Keep every step's row and every finished request's timings for `LLM.metrics()` and
    # `kvcache report`: about 120 bytes per generated token, so a long-lived engine that needs
    # no report turns it off to keep its memory flat.
    record_metrics: bool = True
    # Write the whole CPU pool once at start-up instead of mapping its pages on first touch
    # (runner/kv_pool/store.py): a server's choice, so no step or handover copy takes page faults.
    prefault_kv_cache: bool = False
    # Speculative decoding by n-gram lookup (step/speculative.py): up to this many guessed
    # tokens checked after a plain greedy request's newest one each step; 0 turns it off.
    speculative_tokens: int = 0
    # Tiers below the device pool (kvcache/tiers, docs/TIERS.md), each off when None: blocks
    # evicted from the pool kept in this process's memory; blocks written to a directory that
    # survives restarts; blocks shared with every engine pointed at one Redis server.
    host_cache_bytes: int | None = None
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 10 * 2**30
    remote_cache_url: str | None = field(default=None, repr=False)  # may carry a password
    # Tokens a disk or Redis value holds (consecutive blocks of a chain, a multiple of the block
    # size): one key and one header per chunk, not per block (LMCache's unit is 256 too);
    # block_size: one block a value.
    cache_chunk_tokens: int = 256
    # The key of the MAC every stored block (a tier's, a cache file's) carries and is checked
    # against; None: the environment's KVCACHE_CACHE_KEY, if any. Without one, stored blocks are
    # trusted input, like the model's files. require_cache_mac refuses to run without a key.
    cache_key: str | None = field(default=None, repr=False)
    require_cache_mac: bool = False
    # vLLM's KV events (runner/kv_events): every block stored in and evicted from the pool,
    # published on ZeroMQ for a router to follow; a dict or vLLM's JSON text is accepted too.
    kv_events_config: KVEventsConfig | None = None
    # Batch-invariant inference (docs/DETERMINISM.md): a request's tokens and log-probabilities
    # are bitwise the same whatever else runs beside it, however its prompt is chunked or
    # cached, and a sampled request without a seed gets one from the engine's seed and its
    # prompt. On the CPU through the C kernels (every attention row summed in one fixed order);
    # on CUDA (or attention_backend="triton") through batch-invariant Triton kernels, eagerly.
    deterministic: bool = False
    # Asynchronous scheduling (vLLM's --async-scheduling; runner/engine/step/overlap.py): the host
    # schedules and prepares step N+1 while the device runs step N. None: on for CUDA, off on
    # the CPU (where the device is the host: nothing to overlap). Never with speculative tokens.
    async_scheduling: bool | None = None
    # Prompts given as segments: the fraction of the reused segments' tokens recomputed with
    # the full context (runner/engine/step/segments.py). 1 recomputes all: the plain engine.
    blend_ratio: float = DEFAULT_BLEND_RATIO
    # Tensor parallelism (runner/model/tensor_parallel.py): the model's heads, MLP and
    # vocabulary split over this many ranks, each a process of its own joined by
    # torch.distributed (gloo on the CPU, NCCL on CUDA; runner/engine/executor/multiproc.py).
    # The ranks meet at a free loopback port, at `distributed_init_method` (tcp://host:port),
    # or as torchrun's environment says.
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    # Which cached block the pool evicts first when it runs short (kvcache/eviction/): "lru"
    # (least recently used), "lfu" (least often used, ties by recency) or "priority" (a
    # request's priority, lower first, ties by recency; the engine's requests all have 0 so
    # far, so it evicts as "lru" does).
    eviction_policy: str = "lru"

    @property
    def overlaps_steps(self) -> bool:
        """Whether the engine runs the overlapped loop (async_scheduling resolved)."""
        wanted = self.async_scheduling
        if wanted is None:
            wanted = str(self.device).startswith("cuda") and self.tensor_parallel_size == 1
        return wanted and not self.speculative_tokens

    @property
    def token_budget(self) -> int:
        """max_num_batched_tokens, or the device's default when it is None."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_TOKEN_BUDGET if str(self.device).startswith("cpu") else GPU_TOKEN_BUDGET

    @property
    def has_tiers(self) -> bool:
        """Whether any tier below the device pool is configured."""
        return bool(self.host_cache_bytes or self.disk_cache_dir or self.remote_cache_url)

    def __post_init__(self) -> None:
        self._check_device_and_dtype()
        self._check_scheduling()
        self._check_memory()
        self._check_kernels()
        self._check_tiers()
        self._check_features()

    def _check_device_and_dtype(self) -> None:
        """The device, the KV-events config (parsed in place) and the model's dtype (its
        aliases resolved in place)."""
        if not DEVICE_PATTERN.fullmatch(str(self.device)):  # a torch.device passes as its name
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.kv_events_config is not None:
            parsed = KVEventsConfig.parse(self.kv_events_config)
            object.__setattr__(self, "kv_events_config", parsed)
        if self.dtype == "auto":  # vLLM's name for the default
            object.__setattr__(self, "dtype", None)
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[str(self.dtype)])
        if self.dtype is not None and self.dtype not in MODEL_DTYPES:
            raise ValueError(
                f"dtype must be one of {MODEL_DTYPES}, {tuple(DTYPE_ALIASES)}, 'auto' or None, "
                f"got {self.dtype!r}"
            )

    def _check_scheduling(self) -> None:
        """Blocks, the batching policy, and what a step and a request may hold."""
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not isinstance(self.batching, str) or not self.batching:
            raise ValueError(f"batching must name a scheduling policy, got {self.batching!r}")
        _check_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_at_least("max_num_seqs", self.max_num_seqs, 1)
        _check_at_least("max_model_len", self.max_model_len, 2)
        _check_at_least("max_wait_steps", self.max_wait_steps, 0)

    def _check_memory(self) -> None:
        """The KV pool's size and the workers it is spread over."""
        _check_at_least("num_kv_blocks", self.num_kv_blocks, 1)
        _check_at_least("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _check_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async_scheduling runs one worker: it needs tensor_parallel_size=1")

    def _check_kernels(self) -> None:
        """The attention backend, the CPU's packed weights, the KV cache's dtype."""
        if self.attention_backend not in (None, *BACKEND_NAMES):
            raise ValueError(
                f"attention_backend must be one of {BACKEND_NAMES}, got {self.attention_backend!r}"
            )
        if self.cpu_weight_dtype not in CPU_WEIGHT_DTYPES:
            raise ValueError(
                f"cpu_weight_dtype must be one of {CPU_WEIGHT_DTYPES}, "
                f"got {self.cpu_weight_dtype!r}"
            )
        if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r}: no 8-bit KV cache here; 'float16' "
                "stores a float32 model's keys and values in half the bytes, 'auto' in the "
                "model's dtype"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )

    def _check_tiers(self) -> None:
        """The tiers below the device pool, their chunks and signing, and eviction."""
        _check_at_least("host_cache_bytes", self.host_cache_bytes, 1)
        # A chunk smaller than a block (the default with blocks over 256 tokens) is one block.
        chunk = self.cache_chunk_tokens
        if chunk < 1 or (chunk > self.block_size and chunk % self.block_size):
            raise ValueError(
                f"cache_chunk_tokens must be a positive multiple of block_size "
                f"({self.block_size}), got {chunk}"
            )
        if self.cache_key == "":  # an unset $SECRET: signing must not silently turn off
            raise ValueError("cache_key is empty: give a key, or None for no signing")
        _check_at_least("disk_cache_bytes", self.disk_cache_bytes, 1)
        if self.remote_cache_url is not None and not self.remote_cache_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                "remote_cache_url must look like redis://host:port/db, "
                f"got {redact_url(self.remote_cache_url)!r}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {', '.join(sorted(EVICTION_POLICIES))}, "
                f"got {self.eviction_policy!r}"
            )
        if self.has_tiers and not self.enable_prefix_caching:
            raise ValueError("host/disk/remote cache tiers need the prefix cache on")

    def _check_features(self) -> None:
        """Deterministic sums, blending and speculative tokens."""
        if self.deterministic:
            self._check_deterministic()
        if not 0.0 <= self.blend_ratio <= 1.0:
            raise ValueError(f"blend_ratio must be in [0, 1], got {self.blend_ratio}")
        if not 0 <= self.speculative_tokens <= 16:
            raise ValueError(
                f"speculative_tokens must be in [0, 16], got {self.speculative_tokens}"
            )

    def _check_deterministic(self) -> None:
        """deterministic=True where its sums can be fixed. On CUDA, and on the CPU with
        attention_backend="triton" (the same kernels in Triton's interpreter): the Triton path's
        batch-invariant products and attention (runner/backends/triton/batch_invariant*.py).
        Elsewhere on the CPU: the C kernels on float32 activations and panels whose products
        are per-row (the loader refuses a machine without the kernels:
        runner/backends/cpu/attention.py batch_invariant_backend)."""
        on_cuda = not str(self.device).startswith("cpu")
        if on_cuda or self.attention_backend == "triton":
            if self.attention_backend not in (None, "triton"):
                raise ValueError(
                    f"deterministic=True on CUDA runs the batch-invariant Triton kernels: "
                    f"attention_backend={self.attention_backend!r} cannot be combined with it "
                    f"(docs/DETERMINISM.md)"
                )
            if self.cpu_weight_dtype != "float32":
                raise ValueError(
                    f"deterministic=True with the Triton kernels multiplies the model's own "
                    f"weights: cpu_weight_dtype={self.cpu_weight_dtype!r} cannot be combined "
                    f"with it (docs/DETERMINISM.md)"
                )
            return
        fits = {
            "cpu_kernels": self.cpu_kernels,
            "prepack_weights": self.prepack_weights,
            "attention_backend": self.attention_backend in (None, "cpu"),
            "dtype": self.dtype in (None, "float32"),
            "cpu_weight_dtype": self.cpu_weight_dtype in DETERMINISTIC_WEIGHT_DTYPES,
        }
        for name, fit in fits.items():
            if not fit:
                raise ValueError(
                    f"deterministic=True needs the CPU's C kernels on float32 activations: "
                    f"{name}={getattr(self, name)!r} cannot be combined with it "
                    f"(docs/DETERMINISM.md)"
                )


def _check_at_least(name: str, value: int | None, minimum: int) -> None:
    """ValueError naming the field when it is set below `minimum` (None: unset, nothing to
    check)."""
    if value is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
