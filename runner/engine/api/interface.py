"""The engine interface: everything outside runner/engine (serve, disagg, the CLI, the bench)
asks the engine through this Protocol and nothing else. `LLM` (llm.py) implements it; its
parts (scheduler, block manager, recorder, tiers, KV pool) stay behind it, so a caller never
learns how the engine is built, and mypy checks every call.

What it offers: what the engine serves (config, tokenizer, identity, the block format), the
requests and the loop, reports (stats, metrics, queue depth, the cache's counters, the pool),
warm starts, the cached prefix of a prompt and its blocks as block values, putting handed-over
blocks into the pool, and listeners told of every block committed to the cache and removed
from it (KV events and the handover's commit tap are such listeners). For the measuring code
(bench/) it also offers the recorded steps, a listener told of each step's schedule, whether
any request is still held, and, for profilers only, what runs a step's forward (the model,
its C layers, its decode graphs, the attention backend). Each call says whether it mutates;
all take the engine's lock themselves (`lock` is for a caller that must make several calls
one view)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.engine.requests.validation import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvcache.block_cache import BlockListener
    from kvcache.radix_tree import Node
    from kvcache.stats import CacheStats
    from kvcache.tiers import BlockSpec, HostTier
    from runner.attention.backend import AttentionBackend
    from runner.engine.api.beam_search import BeamSearchOutput, BeamSearchParams
    from runner.engine.api.streaming import TextStream
    from runner.engine.config import EngineConfig
    from runner.engine.requests.outputs import RequestOutput
    from runner.engine.requests.prompt_inputs import Params
    from runner.engine.requests.validation import Messages
    from runner.engine.sequence import Sequence as Seq
    from runner.engine.step.scheduler import SchedulerOutput
    from runner.model.cpu_layers import CpuLayers
    from runner.model.cuda_graphs import DecodeGraphs
    from runner.model.decoder import CausalLM
    from runner.sampling.params import SamplingParams
    from runner.sampling.structured_outputs import StructuredOutputsParams

# What `generate` takes: one prompt (text, token ids, a vLLM prompt dict) or a list of them.
PromptArg = Prompt | Mapping[str, Any] | Sequence[Prompt | Mapping[str, Any]]


class QueueDepth(NamedTuple):
    """The scheduler's queues now: what a server's gauges and its admission read."""

    running: int  # sequences in the running batch
    waiting: int  # sequences queued, not yet admitted (preempted ones among them)
    preemptions: int  # so far
    last_step_tokens: int  # positions the latest step computed (vLLM's iteration tokens)


class KVPool(NamedTuple):
    """The device pool's shape: how much KV it holds and in what."""

    num_blocks: int
    block_size: int  # tokens a block
    dtype_name: str  # the K/V elements' dtype as torch names it ("float16")
    nbytes: int  # the pool's memory

    @property
    def num_slots(self) -> int:
        """Tokens the pool holds when full."""
        return self.num_blocks * self.block_size


class CachedPrefix(NamedTuple):
    """How much of a prompt the device pool holds now, in full blocks from its first, up to the
    block before the one holding its last token (that token is always computed)."""

    blocks: int
    block_size: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


class InstalledBlocks(NamedTuple):
    """What `install_blocks` did: blocks of those given that the pool holds afterwards, and
    how many of them it copied in (the rest it held already)."""

    held: int
    loaded: int


class StepRecord(NamedTuple):
    """One recorded engine step (config.record_metrics): what it computed and when."""

    t_start_s: float  # from `metrics_t0`
    duration_s: float
    num_prefill_tokens: int  # prompt positions computed (chunks included)
    num_decode_tokens: int  # decode positions computed, guessed tokens included


class ForwardParts(NamedTuple):
    """What runs a step's forward, for a profiler (bench/) to read and time, never to change
    (`attend_through` is the one change a profiler makes)."""

    model: CausalLM
    cpu_layers: CpuLayers | None  # the C layer stack, when the CPU backend runs steps there
    decode_graphs: DecodeGraphs | None  # decode steps' CUDA graphs, when captured
    attention: AttentionBackend  # the backend every eager forward attends through


class ServingEngine(Protocol):
    """What a front end that serves requests needs (kvcache serve, kvcache generate, the soak):
    the model it serves, requests and the loop, the checks a caller makes before it queues,
    and the reports."""

    # -- what it serves (fixed for the engine's life) ------------------------------------------
    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer; None for a model without one."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def fingerprint(self) -> str:
        """The model's identity: block hashes are rooted in it (and in a request's salt)."""

    @property
    def model_path(self) -> Path: ...

    @property
    def eos_ids(self) -> AbstractSet[int]:
        """The token ids that end a request (unless it ignores EOS)."""

    @property
    def block_spec(self) -> BlockSpec:
        """What a block value (kvcache/tiers/block_value.py) must agree with to load here."""

    @property
    def cache_mac_key(self) -> bytes | None:
        """The key block values are signed with (None: unsigned)."""

    @property
    def lock(self) -> threading.RLock:
        """Held by every call that reads or changes the engine's state (re-entrant): hold it
        to make several calls one view, or to keep a step from falling between two."""

    # -- requests and the loop (each mutates) --------------------------------------------------
    def add_request(
        self,
        prompt: Prompt | SegmentedPrompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        priority: int = 0,
    ) -> Seq:
        """Validate and queue one request (ValueError names the problem); sample 0's
        sequence."""

    def samples_of(self, request_id: str) -> list[Seq]:
        """The live sequences of a request (pure)."""

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def has_unfinished(self) -> bool:
        """Whether anything is queued, running or waiting for `step` (pure)."""

    def has_live_requests(self) -> bool:
        """Whether the engine still holds any request by id (queued, running, or a sample
        group not all finished); False once every request has finished, else a leak (pure)."""

    def step(self) -> list[RequestOutput]:
        """One engine step; the requests that finished."""

    def run_until_done(
        self, on_finish: Callable[[RequestOutput], None] | None = None
    ) -> list[RequestOutput]: ...

    def generate(
        self, prompts: PromptArg, sampling_params: Params = None, *, cache_salt: str | None = None
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs in input order. Only the keywords the other
        packages pass: `LLM.generate` takes vLLM's `use_tqdm`, `params` and `priority` too."""

    def beam_search(
        self, prompts: PromptArg, params: BeamSearchParams | None = None
    ) -> list[BeamSearchOutput]: ...

    # -- checks a caller makes before it queues (pure) -----------------------------------------
    def apply_chat_template(
        self, messages: Messages, chat_template_kwargs: dict[str, Any] | None = None
    ) -> str: ...

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming why a request with this prompt and these params cannot
        run here; return quietly when it can."""

    def room_for(self, token_ids: list[int], max_tokens: int | None) -> int:
        """The new tokens a request may make (`max_tokens`, or what the context leaves)."""

    def check_structured_outputs(self, spec: StructuredOutputsParams | None) -> None:
        """Compile a structure (ValueError when it cannot be, or when no answer fits it)."""

    def text_stream(self, skip_special_tokens: bool = True) -> TextStream:
        """A fresh incremental detokenizer for one sample's streamed text."""

    def output_text(self, seq: Seq) -> str:
        """A sample's text as its output carries it: decoded, cut before a stop string (what a
        stream's last delta completes). Pure."""

    # -- reports (pure) ------------------------------------------------------------------------
    def segment_stats(self) -> dict[str, float | int]:
        """Reuse of prompts' later segments: tokens asked, served, recomputed (pure)."""
        ...

    def stats(self) -> dict[str, Any]:
        """The cache's counters, the pool's state, hit rate, preemptions, speculation."""

    def metrics(self) -> dict[str, Any]:
        """Every recorded step and request (ValueError unless config.record_metrics)."""

    @property
    def metrics_t0(self) -> float:
        """The `time.perf_counter()` the recorded steps' times count from."""

    def recorded_steps(self, first: int = 0) -> list[StepRecord]:
        """The recorded steps from the ``first``-th on (counted from the end when negative, as
        a slice is); none when config.record_metrics is off. Pure."""

    def queue_depth(self) -> QueueDepth: ...

    def cache_stats(self) -> CacheStats:
        """A snapshot of the device cache's counters and its blocks' states."""

    def kv_pool(self) -> KVPool: ...

    def check_integrity(self) -> None:
        """Raise AssertionError when the cache's structures disagree (tests, soaks)."""


class BlockEngine(Protocol):
    """What the cache's other users need (the prefill/decode handover, the tiers' tools, a KV
    events subscriber): its blocks, their events, warm starts."""

    def kv_event_endpoints(self) -> dict[str, str | bool | None] | None:
        """Where the engine publishes vLLM's KV events (endpoint, binds, replay_endpoint,
        topic); None when it publishes none."""

    # -- warm starts ---------------------------------------------------------------------------
    def save_prefix_cache(self, path: str | Path) -> int: ...

    def load_prefix_cache(self, path: str | Path) -> int: ...

    def flush_cache_tiers(self) -> None: ...

    def write_waiting_blocks(self) -> None:
        """Queue the committed blocks waiting for room in the tiers' write queue, as far as
        it has room now (an idle engine's thread; no wait)."""

    def reset_prefix_cache(self) -> bool: ...

    # -- the cache's blocks --------------------------------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None) -> CachedPrefix:
        """How much of the prompt the pool holds now. Pure: no stats, no LRU touch."""

    def cached_block_values(self, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The block values (header, tokens, parent hash, checksum, MAC) of the prompt's
        blocks the pool holds now, in chain order (`cached_prefix`'s blocks). Holds the lock
        while it copies their K/V off the pool, then encodes without it. Pure."""

    def block_values(self, nodes: Sequence[Node]) -> list[bytes]:
        """The block values of cached blocks a listener was told of (`blocks_stored`), read
        off the pool now: for a listener, inside the step that committed them. Pure."""

    def add_block_listener(self, listener: BlockListener) -> None:
        """Tell ``listener`` of every block committed to the cache (after the forward that
        wrote its K/V) and removed from it, beside every other listener, on the engine's
        thread inside its lock. Mutates only the listener list."""

    def remove_block_listener(self, listener: BlockListener) -> None:
        """Stop telling ``listener`` (ValueError if it was not added)."""

    def host_tier(self) -> HostTier | None:
        """The host-memory tier below the pool, if the engine has one."""

    def install_blocks(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        first: int,
        kvs: Sequence[bytes | memoryview],
    ) -> InstalledBlocks:
        """Put checked K/V (blocks ``first``, ``first + 1``, ... of the prompt, from a
        handover) into the pool as cached blocks, as many as it can spare now; the pool must
        hold the blocks before ``first`` (else none is put). ``token_ids``: the blocks' tokens
        and at least one more. Mutates the pool."""


class ProfilingEngine(Protocol):
    """What the measuring code needs (bench/): the step's parts, to read and time."""

    # -- for the measuring code (bench/) -------------------------------------------------------
    def add_schedule_listener(self, listener: Callable[[SchedulerOutput], None]) -> None:
        """Tell ``listener`` each step's schedule (what it computes, for which sequences) before
        its forward runs, on the engine's thread inside its lock, for the engine's life (a
        soak's count of what the model is really fed). Mutates only the listener chain."""

    def forward_parts(self) -> ForwardParts:
        """What runs a step's forward, for profilers (pure)."""

    def attend_through(self, backend: AttentionBackend) -> None:
        """Attend through ``backend`` in every eager forward from now on (decode graphs keep
        their own): a profiler's instrumented backend. Mutates."""

    def rank_weight_bytes(self) -> list[int]:
        """Each tensor-parallel rank's weights as held, in bytes (one entry on one device)."""
        ...


@runtime_checkable
class EngineInterface(ServingEngine, BlockEngine, ProfilingEngine, Protocol):
    """The engine as the other packages see it: all three kinds of client's calls (see the
    module's docstring). A client that needs one kind types against that one."""
