"""The engine's front: what a request meets first and last. It builds the engine's parts once,
takes requests in (runner/engine/requests/intake.py fits the prompt, picks the id, builds the
sequences), hands them to the core (runner/engine/step/core.py: schedule, execute, settle), and
routes their outputs back to whoever waits for them. `LLM` (runner/engine/api/llm.py) adds the
batch calls on top: generate, chat, stream."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runner.engine.config import EngineConfig
from runner.engine.requests.intake import RequestIntake
from runner.engine.requests.outputs import RequestOutput, TokenTexts
from runner.engine.requests.request_table import LiveRequests, OutputRouter
from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.engine.requests.stopping import StopChecker
from runner.engine.requests.validation import Prompt, RequestValidator
from runner.engine.sequence import Sequence
from runner.engine.step.core import EngineCore
from runner.engine.step.guards import interrupts_held, locked
from runner.engine.step.metrics import MetricsRecorder, StepClock
from runner.engine.step.overlap import default_device
from runner.engine.step.policies.registry import policy_for
from runner.engine.step.scheduler import Scheduler
from runner.engine.step.segments import SegmentReuse
from runner.engine.step.settle import StepSettler
from runner.engine.step.setup import build_engine_parts
from runner.engine.step.speculative import SpecStats
from runner.model.cpu_layers import CpuLayers
from runner.model.loader import generation_eos_ids
from runner.sampling.params import SamplingParams
from runner.sampling.structured_outputs import GrammarBook

if TYPE_CHECKING:
    from runner.kv_events.publisher import KVEventPublisher


class Engine:
    """Requests, one step at a time, over a prefix cache that persists across requests."""

    def __init__(self, model: str | None = None, *, seed: int = 0, **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        policy_for(self.config.batching)  # a bad name fails before the model loads
        parts = build_engine_parts(self.config)
        loaded = parts.loaded
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.config
        self.fingerprint = loaded.fingerprint
        self.model_path = loaded.path
        self.device = parts.device
        self.max_model_len = parts.max_model_len
        self.kv, self.block_manager, self.runner = parts.kv, parts.block_manager, parts.runner
        self.block_spec, self.tiers = parts.block_spec, parts.tiers
        self.cache_mac_key = parts.cache_mac_key
        # The worker in this process, or N tensor-parallel ranks (runner/engine/executor).
        self.executor = parts.executor
        self.kv_events = self._publish_kv_events()
        self.attention = parts.attention  # the backend every forward pass runs
        layers = parts.attention.layers
        # Whole steps in C (runner/model/cpu_layers.py), where the CPU backend has them.
        self.cpu_layers = layers if isinstance(layers, CpuLayers) else None
        self.scheduler = self._scheduler()
        self.stopper = StopChecker(
            self.hf_config, self.tokenizer, self.max_model_len, generation_eos_ids(self.model_path)
        )
        self.eos_ids = self.stopper.eos_ids
        self.token_texts = TokenTexts(self.tokenizer)  # logprobs' decoded tokens, remembered
        self.grammars = GrammarBook(self.tokenizer, int(self.hf_config.vocab_size), self.eos_ids)
        self.validator, self.intake = self._intake(seed)
        self.recorder = MetricsRecorder(record=self.config.record_metrics)
        self._requests = LiveRequests()  # queued or running requests by id, and sample groups
        self._outputs = OutputRouter()  # finished outputs waiting for the caller they belong to
        self.spec_stats = SpecStats()  # drafted and accepted tokens (speculative.py)
        # Ends each step's requests and books its tokens (settle.py: the step's finishing path).
        self.settler = StepSettler(
            self.scheduler,
            self.stopper,
            self.recorder,
            self.spec_stats,
            self._requests,
            self._outputs,
            self.token_texts,
        )
        # Held by every add, abort and step (guards.py): threads may share an engine.
        self.lock = threading.RLock()
        # Schedule, execute, settle (runner/engine/step/core.py); on CUDA, with the next step
        # queued before this one settles (overlap.py).
        self.core = EngineCore(
            self.scheduler,
            self.runner,
            self.executor,
            self.settler,
            StepClock(self.model, self.cpu_layers, on_cpu=self.device.type == "cpu"),
            self.eos_ids,
            default_device(self.device) if self.config.overlaps_steps else None,
        )
        self.overlap = self.core.overlap
        self.clock = self.core.clock

    def _publish_kv_events(self) -> KVEventPublisher | None:
        """vLLM's KV events, where asked: a listener on the pool's tree (and the host and disk
        tiers' blocks, under their media), its own thread publishing."""
        events = self.config.kv_events_config
        if events is None or not events.publishes:
            return None
        # Imported only when on: ZeroMQ and msgspec are not on every machine (a GPU image).
        from runner.kv_events.publisher import KVEventPublisher
        from runner.kv_events.tier_events import publish_tier_events

        publisher = KVEventPublisher(events, self.config.block_size)
        self.block_manager.add_listener(publisher)
        if self.tiers is not None:
            publish_tier_events(self.tiers.store, publisher, self.config.block_size)
        return publisher

    def _scheduler(self) -> Scheduler:
        """The scheduler over the block manager and the tiers, and, where prefixes are shared,
        prompts' later segments reused from their own cache (segments.py)."""
        scheduler = Scheduler(
            self.config, self.block_manager, self.max_model_len, self._copy_slots, self.tiers
        )
        if self.block_manager.shares_prefixes:
            scheduler.segments = SegmentReuse(
                self.block_manager,
                self.runner,
                self.config.blend_ratio,
                self._copy_slots,
                self.tiers,
                self._run_ordered,
            )
        return scheduler

    def _intake(self, seed: int) -> tuple[RequestValidator, RequestIntake]:
        """What checks a request against the model, the context and the pool, and the intake
        that turns a call into sequences."""
        validator = RequestValidator(
            vocab_size=int(self.hf_config.vocab_size),
            max_model_len=self.max_model_len,
            pool_tokens=self.block_manager.num_blocks * self.config.block_size,
            block_size=self.config.block_size,
            has_tokenizer=self.tokenizer is not None,
            eos_ids=frozenset(self.eos_ids),
        )
        intake = RequestIntake(
            tokenizer=self.tokenizer,
            fingerprint=self.fingerprint,
            block_size=self.config.block_size,
            validator=validator,
            grammars=self.grammars,
            seed=seed,
            deterministic=self.config.deterministic,
        )
        return validator, intake

    # ------------------------------------------------------------------ requests
    @locked
    def add_request(
        self,
        prompt: Prompt | SegmentedPrompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        priority: int = 0,
    ) -> Sequence:
        """Validate and queue one request; raises ValueError naming the problem. Returns its
        sequence; with params.n > 1 it queues n (request ids "<id>#<j>", see `samples_of`),
        returns sample 0's, and `step` hands back one RequestOutput once all have finished.
        `priority` (vLLM's), a lower value the more urgent request: admitted first under
        batching="priority", its blocks kept longer under eviction_policy="priority"."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        seqs, group, prefix_key = self.intake.sequences(
            prompt,
            params,
            request_id=request_id,
            cache_salt=cache_salt,
            add_special_tokens=add_special_tokens,
            taken=self._taken,
        )
        with interrupts_held():  # the request is queued whole (every sample) or not at all
            if group is not None:
                self._requests.add_group(group, len(seqs))
            for seq in seqs:
                seq.priority = priority
                self.recorder.add_request(seq, prefix_key)
                self.scheduler.add(seq)
                self._requests.add(seq)
        return seqs[0]

    def _taken(self, request_id: str) -> bool:
        """Whether an id is in use: queued, running, finished with its output not yet handed
        back, or one of a running `generate`'s or stream's."""
        return request_id in self._requests or self._outputs.holds(request_id)

    @locked
    def samples_of(self, request_id: str) -> list[Sequence]:
        """The live sequences of a request: its one, or those of its samples still running."""
        return self._requests.samples_of(request_id)

    @locked
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a queued or running request (every sample of it) and free its blocks; returns
        what it generated so far (finish_reason "abort"), its output if it finished but was
        not handed back yet, or None when there is no such request."""
        kept = self._outputs.take({request_id})
        if kept:  # it finished already: its output is all there is, and no one else gets it
            return kept[0]
        if self.overlap is not None:  # what it generated so far includes the step in flight's
            self.core.settle_inflight()
            kept = self._outputs.take({request_id})
            if kept:  # that step finished it
                return kept[0]
        result = None
        with interrupts_held():  # a half-done abort would leave blocks held by no one
            for seq in self.samples_of(request_id):
                result = self.settler.finish(seq, "abort")  # the last one's is the whole request's
        return result

    def _root(self, cache_salt: str | None) -> int:
        return self.intake.root(cache_salt)

    @locked
    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or has finished with its output waiting
        for `step` (not counting outputs a running `generate` or stream waits for)."""
        return self._outputs.any_for_step() or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    @locked
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it, and any that
        finished while `generate` or `stream` ran the engine for requests of their own."""
        self._step()
        return self._outputs.for_step()

    @locked
    def reserve_outputs(self, request_ids: set[str]) -> None:
        """Hand these requests' outputs only to `step_for` (a `generate` or a stream that
        queued them waits for them), never to `step`."""
        self._outputs.reserve(request_ids)

    @locked
    def release_outputs(self, request_ids: set[str]) -> None:
        """End `reserve_outputs` for these requests: aborted what still runs, dropped what
        waits (the caller that reserved them is gone)."""
        for request_id in request_ids:
            self.abort_request(request_id)
        self._outputs.unreserve(request_ids)

    @locked
    def step_for(self, request_ids: set[str]) -> list[RequestOutput]:
        """Those of `request_ids` that finished since the last call: kept from another
        caller's step, or, if none was kept and any of them is still running, in one engine
        step run now. Other requests' outputs are kept for the next `step` or `step_for` that
        asks for them, never lost."""
        mine = self._outputs.take(request_ids)
        if mine or not any(self.samples_of(rid) for rid in request_ids):
            return mine
        self._step()
        return self._outputs.take(request_ids)

    @property
    @locked
    def kept(self) -> set[str]:
        """Ids of finished requests whose outputs wait for the `step` or `step_for` that asks."""
        return self._outputs.waiting_ids()

    def _step(self) -> None:
        """One engine step (the core's)."""
        self.core.step()

    def _copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        self.core.copy_slots(src_block, dst_block, num_tokens)

    def _run_ordered(self, op: Callable[[], None]) -> None:
        self.core.run_ordered(op)

    def shutdown(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks); the engine cannot step
        afterwards. An engine that is collected stops them too."""
        self.core.shutdown()
