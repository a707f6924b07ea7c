"""LLM: the user-facing engine. Batch calls (generate, chat, stream) over the engine loop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from runner.engine.api.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from runner.engine.api.engine_calls import EngineCalls
from runner.engine.api.frozen_heap import frozen_heap
from runner.engine.api.interface import PromptArg
from runner.engine.api.streaming import StreamDelta, stream_requests
from runner.engine.api.vllm_args import pop_vllm_args
from runner.engine.kv.prefix_cache_file import cache_identity, load_prefix_cache, save_prefix_cache
from runner.engine.requests.outputs import RequestOutput
from runner.engine.requests.prompt_inputs import (
    Params,
    PromptInput,
    chat_template_options,
    prompt_inputs,
    sampling_params_arg,
)
from runner.engine.requests.validation import (
    Messages,
    conversation_batch,
    params_per_prompt,
    prompt_token_ids,
    render_chat,
)
from runner.engine.sequence import Sequence, request_id_of
from runner.engine.step.guards import locked
from runner.engine.step.segments import SegmentStats
from runner.sampling.params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from runner.engine.api.interface import EngineInterface

log = logging.getLogger(__name__)


class LLM(EngineCalls):
    """Generation with a prefix cache that persists across calls of one instance.

    The calls take vLLM's names and forms beside ours (runner/engine/requests/prompt_inputs.py):
    `generate(prompts, sampling_params)` or `params=`, prompt dicts, `chat`'s template
    keywords; `LLM(model=...)` takes a local folder, a .gguf file or a Hugging Face Hub id."""

    def __init__(
        self,
        model: str | None = None,
        *,
        seed: int = 0,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        **options: Any,
    ) -> None:
        """`model` and `options` as EngineConfig names them (vLLM's names where vLLM has the
        option). vLLM's `tokenizer` may name the model itself (its own tokenizer is the one
        used); `trust_remote_code` is accepted and changes nothing: this engine runs its own
        model code, never a repository's. vLLM's other arguments (`tensor_parallel_size`,
        `swap_space`, `quantization`, `tokenizer_mode`, ...) are taken as
        runner/engine/api/vllm_args.py says: in silence where this engine does what they ask,
        with one warning where they mean nothing here, a ValueError naming them where they
        cannot be honoured. Unknown names raise TypeError."""
        options = pop_vllm_args(options, model)
        if tokenizer is not None and not same_model(tokenizer, model):
            raise ValueError(
                f"tokenizer={tokenizer!r}: only the model's own tokenizer is supported; "
                "leave tokenizer unset or name the model"
            )
        if trust_remote_code:
            log.info("trust_remote_code: no model repository code is run here; it is ignored")
        if "gpu_memory_utilization" in options and not str(options.get("device")).startswith(
            "cuda"
        ):
            log.warning(
                "gpu_memory_utilization sizes the KV pool on a GPU only; on the CPU it is "
                "ignored (num_kv_blocks or kv_cache_memory_bytes size the pool there)"
            )
        super().__init__(model, seed=seed, **options)

    def generate(
        self,
        prompts: PromptArg,
        sampling_params: Params = None,
        *,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        params: Params = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or vLLM's {"prompt": ...} or
        {"prompt_token_ids": [...]} dict); outputs come back in input order. `sampling_params`
        (vLLM's name) or `params`: one for all prompts or one per prompt. `priority` (vLLM's):
        one integer a prompt, a lower one the more urgent: admitted first under
        batching="priority", its cached blocks kept longer under eviction_policy="priority"."""
        batch = prompt_inputs(prompts)
        chosen = sampling_params_arg(sampling_params, params)
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"priority has {len(priority)} entries for {len(batch)} prompts")
        return self._generate_all(
            batch, chosen, use_tqdm, cache_salt, chat=False, priority=priority
        )

    def chat(
        self,
        messages: Seq[Messages] | Messages,
        sampling_params: Params = None,
        *,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        params: Params = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`) to each conversation, then
        generate. The keywords mean what vLLM's do: `tools` reach the template as `tools`,
        `continue_final_message` leaves the last assistant message open to be continued (with
        add_generation_prompt=False), and `chat_template_kwargs` (such as Qwen3's
        `enable_thinking`) go to the template over them."""
        options = chat_template_options(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
        )
        texts = self._chat_texts(messages, options)
        chosen = sampling_params_arg(sampling_params, params)
        return self._generate_all(texts, chosen, use_tqdm, cache_salt, chat=True)

    def stream(
        self,
        prompts: PromptArg,
        sampling_params: Params = None,
        *,
        cache_salt: str | None = None,
        params: Params = None,
    ) -> Iterator[StreamDelta]:
        """Like `generate`, but yield each request's new tokens and text after every step
        (runner/engine/api/streaming.py); a sample's deltas add up to its final text exactly, and a
        request's last delta carries its RequestOutput. The requests are queued when the
        iteration starts (a bad prompt raises there); leaving the loop early aborts the rest."""
        batch = prompt_inputs(prompts)
        chosen = sampling_params_arg(sampling_params, params)
        return stream_requests(self, lambda: self._queue_all(batch, chosen, cache_salt))

    def stream_chat(
        self,
        messages: Seq[Messages] | Messages,
        sampling_params: Params = None,
        *,
        cache_salt: str | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        params: Params = None,
    ) -> Iterator[StreamDelta]:
        """`stream` over conversations, with the chat template applied as `chat` applies it."""
        options = chat_template_options(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
        )
        texts = self._chat_texts(messages, options)
        chosen = sampling_params_arg(sampling_params, params)
        return stream_requests(self, lambda: self._queue_all(texts, chosen, cache_salt, True))

    def beam_search(
        self, prompts: PromptArg, params: BeamSearchParams | None = None
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best answers to each prompt (text, token ids or a prompt
        dict) by beam search, as transformers' `generate(num_beams=...)` finds them
        (runner/engine/api/beam_search.py); outputs come back in input order, each with its answers
        best first."""
        params = params if params is not None else BeamSearchParams()
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        params.validate()  # it may have been changed since it was made
        whole = SamplingParams(max_tokens=params.max_tokens)  # a beam must fit the pool alone
        token_ids = []
        for i, prompt in enumerate(prompt_inputs(prompts)):
            try:
                ids = prompt_token_ids(prompt.prompt, self.tokenizer, add_special_tokens=True)
                token_ids.append(ids)
                self.validator.check(token_ids[-1], whole)
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from err
        with frozen_heap():
            return beam_search(self, token_ids, params)

    def apply_chat_template(
        self, messages: Messages, chat_template_kwargs: dict[str, Any] | None = None
    ) -> str:
        """One conversation's prompt text, through the model's chat template."""
        return render_chat(self.tokenizer, messages, chat_template_kwargs)

    def get_default_sampling_params(self) -> SamplingParams:
        """A fresh SamplingParams with this engine's defaults, as vLLM's
        `get_default_sampling_params` (whose scripts set a field or two on it). vLLM takes
        them from the model's generation_config.json unless told not to; here they are
        always SamplingParams' own (vLLM's `--generation-config vllm`)."""
        return SamplingParams()

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer (a transformers tokenizer; None for a model without one), as
        vLLM's `LLM.get_tokenizer`."""
        return self.tokenizer

    @locked
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block of the device pool that no running request holds (full
        blocks and tails; the tiers below keep theirs), as vLLM's `reset_prefix_cache`: later
        prompts find nothing cached but what running requests hold. True when the pool then
        caches nothing at all; False when running requests still hold blocks."""
        self.block_manager.drop_cached()  # KV-event listeners hear each block removed
        cleared = self.block_manager.stats.blocks_in_use == 0
        if cleared and self.kv_events is not None:
            self.kv_events.all_cleared()  # and, as after vLLM's reset, AllBlocksCleared
        return cleared

    def _chat_texts(
        self, conversations: Seq[Messages] | Messages, template_kwargs: dict[str, Any] | None
    ) -> list[PromptInput]:
        return [
            PromptInput(self.apply_chat_template(list(c), template_kwargs))
            for c in conversation_batch(conversations)
        ]

    def _generate_all(
        self,
        prompts: list[PromptInput],
        params: Params,
        use_tqdm: bool,
        cache_salt: str | None,
        chat: bool,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        with self.lock:  # queued and reserved at once: no other caller's step may finish them
            queued = self._queue_all(prompts, params, cache_salt, chat, priority)  # between the two
            order = {request_id_of(samples[0]): i for i, samples in enumerate(queued)}
            self.reserve_outputs(set(order))
        results: list[RequestOutput | None] = [None] * len(prompts)
        pending = set(order)
        try:
            with (
                frozen_heap(),
                tqdm(total=len(prompts), disable=not use_tqdm, desc="generate") as bar,
            ):
                while pending:
                    with self.lock:  # the step and the look at what is left: one view
                        outputs = self.step_for(pending)
                        stalled = not outputs and not any(self.samples_of(r) for r in pending)
                    if stalled:
                        missing = sorted(order[r] for r in pending)
                        raise RuntimeError(f"engine stopped with prompts {missing} unfinished")
                    for output in outputs:
                        results[order[output.request_id]] = output
                        pending.discard(output.request_id)
                        bar.update(1)
        finally:  # interrupted (Ctrl-C): what it queued must not run on, nor pile up outputs
            self.release_outputs(set(order))
        return [r for r in results if r is not None]

    def run_until_done(
        self, on_finish: Callable[[RequestOutput], None] | None = None
    ) -> list[RequestOutput]:
        """Step until nothing is queued, running or waiting for `step`; returns the outputs
        in the order they finished, each also passed to `on_finish` as it comes."""
        done: list[RequestOutput] = []
        with frozen_heap():
            while self.has_unfinished():
                for output in self.step():
                    done.append(output)
                    if on_finish is not None:
                        on_finish(output)
        return done

    def _queue_all(
        self,
        prompts: list[PromptInput],
        params: Params,
        cache_salt: str | None,
        chat: bool = False,
        priority: list[int] | None = None,
    ) -> list[list[Sequence]]:
        """Add one request per prompt, in order; returns each one's samples. Everything is
        validated before anything runs, and a bad prompt takes the ones queued before it back
        out: no orphans. A prompt's own cache salt (a prompt dict's) wins over the call's."""
        param_list = params_per_prompt(params, len(prompts))
        queued: list[list[Sequence]] = []
        try:
            priorities = priority if priority is not None else [0] * len(prompts)
            for prompt, p, rank in zip(prompts, param_list, priorities, strict=True):
                salt = prompt.cache_salt if prompt.cache_salt is not None else cache_salt
                seq = self.add_request(
                    prompt.prompt, p, cache_salt=salt, add_special_tokens=not chat, priority=rank
                )
                queued.append(self.samples_of(request_id_of(seq)))
        except BaseException as err:  # Ctrl-C too: nothing queued may be left to run unseen
            for samples in queued:
                self.abort_request(request_id_of(samples[0]))
            if isinstance(err, ValueError):
                raise ValueError(f"prompt {len(queued)}: {err}") from err
            raise
        return queued

    # ------------------------------------------------------------------ reports
    @locked
    def stats(self) -> dict[str, Any]:
        """The cache's counters and the pool's state now (see CacheStats), with the hit rate
        and the preemptions so far."""
        stats = self.block_manager.stats
        tiers = self.tiers.stats() if self.tiers is not None else None
        return {
            **stats.as_dict(),
            **({"cache_tiers": tiers} if tiers is not None else {}),
            "hit_rate": stats.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_draft_tokens": self.spec_stats.num_draft_tokens,
            "num_accepted_tokens": self.spec_stats.num_accepted_tokens,
            "num_kv_blocks": self.block_manager.num_blocks,
            "block_size": self.config.block_size,
            **self.segment_stats(),
        }

    @locked
    def segment_stats(self) -> dict[str, float | int]:
        """Reuse of prompts' later segments (runner/engine/step/segments.py): tokens asked and
        served from segments' caches, the fraction recomputed, segments cached; zeros when
        segments run as plain tokens (blend_ratio 1)."""
        reuse = self.scheduler.segments
        return (reuse.stats if reuse is not None else SegmentStats()).as_dict()

    @locked
    def metrics(self) -> dict[str, Any]:
        """Every recorded step and request with the run's settings: what `kvcache report`
        reads. Raises ValueError for an engine made with record_metrics=False."""
        if not self.recorder.record:
            raise ValueError("this LLM records no metrics: create it with record_metrics=True")
        header = {
            "model": self.config.model or "SmolLM2-135M-Instruct (default)",
            "batching": self.config.batching,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "block_size": self.config.block_size,
            "num_kv_blocks": self.block_manager.num_blocks,
            "max_num_batched_tokens": self.config.token_budget,
            "cpu_weight_dtype": self.config.cpu_weight_dtype,
            "kv_cache_dtype": self.kv.dtype_name,
            "speculative_tokens": self.config.speculative_tokens,
            "num_draft_tokens": self.spec_stats.num_draft_tokens,
            "num_accepted_tokens": self.spec_stats.num_accepted_tokens,
            **({"cache_tiers": self.tiers.stats()} if self.tiers is not None else {}),
            "segments": self.segment_stats(),
        }
        return self.recorder.to_dict(
            header, self.block_manager.stats, self.scheduler.num_preemptions
        )

    # ------------------------------------------------------------------ warm starts
    @locked
    def save_prefix_cache(self, path: str | Path) -> int:
        """Write the prefix cache (every cached block, its tokens and its K/V) to one file, for
        `load_prefix_cache` in a later engine of the same model; returns the blocks saved."""
        self._one_rank("save_prefix_cache")
        identity, spec, key = self._cache_identity(), self.block_spec, self.cache_mac_key
        return save_prefix_cache(self.block_manager, self.kv, identity, Path(path), spec, key)

    @locked
    def load_prefix_cache(self, path: str | Path) -> int:
        """Load a file written by `save_prefix_cache`: its prefixes are then cached here, as if
        this engine had computed them. Returns the blocks loaded (fewer than saved when the
        pool fills up, or when blocks fail their checksum or MAC: those are dropped with the
        blocks below them, with a warning). Raises ValueError for a file saved for another
        model, weight rounding, block size or K/V layout, or one that is not a cache file;
        nothing is loaded then."""
        self._one_rank("load_prefix_cache")
        identity, request_id = self._cache_identity(), next(self.intake.seq_ids)
        bm, spec, key = self.block_manager, self.block_spec, self.cache_mac_key
        vocab = int(self.hf_config.vocab_size)  # its token ids are checked against it
        return load_prefix_cache(
            bm, self.kv, identity, Path(path), request_id, spec, key, vocab_size=vocab
        )

    def flush_cache_tiers(self) -> None:
        """Wait until every block queued for the disk and remote tiers is written (a process
        about to exit, or to hand its tiers to another engine); nothing without tiers."""
        if self.tiers is not None:
            self.tiers.flush()

    @locked
    def write_waiting_blocks(self) -> None:
        """Queue the blocks waiting for room in the tiers' write queue, as far as it has room
        now, without waiting (an idle server's engine thread calls it)."""
        if self.tiers is not None:
            self.tiers.write_waiting()

    def _one_rank(self, call: str) -> None:
        """The prefix-cache file holds one pool's blocks: a tensor-parallel engine keeps its
        blocks across restarts in a disk tier instead (its values hold every rank's shard)."""
        if self.config.tensor_parallel_size > 1:
            raise ValueError(
                f"{call} takes one rank's pool; with tensor_parallel_size="
                f"{self.config.tensor_parallel_size}, a disk tier (disk_cache_dir) keeps the "
                "cache across restarts"
            )

    def _cache_identity(self) -> dict[str, str]:
        return cache_identity(self.kv, self.fingerprint, self.config.cpu_weight_dtype)


def same_model(tokenizer: str, model: str | None) -> bool:
    """Whether vLLM's `tokenizer` argument names `model` (the same id, or the same folder)."""
    if model is None:
        return False
    if tokenizer == model:
        return True
    tok, mod = Path(tokenizer).expanduser(), Path(model).expanduser()
    return tok.exists() and mod.exists() and tok.resolve() == mod.resolve()


if TYPE_CHECKING:  # mypy checks here that LLM offers the whole interface
    _implements: type[EngineInterface] = LLM
