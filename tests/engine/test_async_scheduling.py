"""Asynchronous scheduling (runner/engine/step/overlap.py) on a fake device whose steps run on a
worker thread with a set latency, beside host preparation with a set cost of its own.

Two claims: the host prepares step N+1 before it reads step N's tokens (so a step costs about
max(host, device), not their sum: shown by the order of recorded events, never by a timing
threshold), and the outputs equal the plain synchronous loop's, token for token, with chunked
prefill, a stop string found one step late, max_tokens, an abort mid-run, preemption in a
small pool, sampled requests with seeds, and streaming."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvcache import LLM, RequestOutput, SamplingParams, StructuredOutputsParams
from runner.cli.engine_options import engine_options
from runner.engine.config import EngineConfig
from runner.engine.step.model_runner import ALIGN, upload
from runner.engine.step.overlap import PendingTokens
from runner.engine.step.scheduler import SchedulerOutput

DEVICE_LATENCY_S = 0.004  # each step's device work: the real CPU forward, then this sleep
HOST_COST_S = 0.002  # each step's host preparation: the real one, then this sleep

Events = list[tuple[str, int]]


class _WorkerTokens:
    def __init__(self, future: Future[torch.Tensor], step: int, events: Events) -> None:
        self.future, self.step, self.events = future, step, events

    def on_device(self) -> torch.Tensor:
        return self.future.result()  # runs on the worker after this step's work: done

    def wait(self) -> list[int]:
        tokens = self.future.result()
        self.events.append(("read", self.step))
        return [int(t) for t in tokens.tolist()]


class ThreadedDevice:
    """A device that runs each step's work on one worker thread, in submission order, and
    holds it DEVICE_LATENCY_S longer: the host goes on while it runs, as with a GPU."""

    def __init__(self, events: Events) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-device")
        self.events = events
        self.steps = 0

    def submit(self, work: Callable[[], torch.Tensor]) -> PendingTokens:
        step = self.steps
        self.steps += 1

        def run() -> torch.Tensor:
            self.events.append(("device", step))
            tokens = work()
            time.sleep(DEVICE_LATENCY_S)
            return tokens

        return _WorkerTokens(self.pool.submit(run), step, self.events)

    def run_ordered(self, op: Callable[[], None]) -> None:
        self.pool.submit(op).result()


def engine(path: Path, overlapped: bool, events: Events | None = None, **options: Any) -> LLM:
    """An engine on the fake device (overlapped) or the plain loop, its host preparation
    costing HOST_COST_S more and recorded as ("prepare", n) in `events`."""
    llm = LLM(str(path), async_scheduling=overlapped, **options)
    log: Events = events if events is not None else []
    if overlapped:
        assert llm.overlap is not None
        llm.overlap.device = ThreadedDevice(log)
    else:
        assert llm.overlap is None
    prepare = llm.runner.prepare
    count = iter(range(10**6))

    def costly_prepare(batch: Any) -> Any:
        log.append(("prepare", next(count)))
        time.sleep(HOST_COST_S)
        return prepare(batch)

    llm.runner.prepare = costly_prepare  # type: ignore[method-assign]
    if not overlapped:  # the plain loop reads each step's tokens as its forward ends
        forward = llm.runner.forward
        steps = iter(range(10**6))

        def recorded_forward(*args: Any) -> torch.Tensor:
            step = next(steps)
            log.append(("device", step))
            logits = forward(*args)
            log.append(("read", step))
            return logits

        llm.runner.forward = recorded_forward  # type: ignore[method-assign]
    return llm


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def assert_idle(llm: LLM) -> None:
    assert not llm.has_unfinished()
    assert llm.overlap is None or llm.overlap.inflight is None
    llm.block_manager.check_integrity()


@pytest.mark.parametrize("overlapped", [True, False])
def test_the_host_prepares_the_next_step_before_reading_this_ones_tokens(
    tiny_llama_dir: Path, overlapped: bool
) -> None:
    """Overlapped: each step's preparation begins before the previous step's tokens are read,
    so host and device work at once. The plain loop never does (this is what the assertion
    tells apart)."""
    events: Events = []
    llm = engine(tiny_llama_dir, overlapped, events)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.generate(prompts(4), params)
    order = {event: i for i, event in enumerate(events)}
    steps = sum(1 for name, _ in events if name == "prepare")
    assert steps >= 12  # a prefill step, then a decode step per token
    early = [n for n in range(1, steps) if order[("prepare", n)] < order[("read", n - 1)]]
    if overlapped:
        assert early == list(range(1, steps))
        assert llm.overlap is not None and llm.overlap.synchronous_steps == 0
    else:
        assert early == []


VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "small-pool": {"num_kv_blocks": 32, "block_size": 2},  # preempts, re-admits
    "static": {"batching": "static"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_outputs_equal_the_plain_loops(tiny_llama_dir: Path, variant: str) -> None:
    options = VARIANTS[variant]
    rng = random.Random(1)
    params = [
        SamplingParams(max_tokens=rng.randint(1, 20), temperature=0, ignore_eos=True)
        for _ in range(7)
    ]
    batch = prompts(7, seed=2)
    plain = engine(tiny_llama_dir, False, **options)
    expected = plain.generate(batch, params)
    overlapped = engine(tiny_llama_dir, True, **options)
    got = overlapped.generate(batch, params)
    assert tokens(got) == tokens(expected)
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(got, params, strict=True))
    if variant == "small-pool":
        assert overlapped.scheduler.num_preemptions > 0
    assert_idle(overlapped)
    # Warm: the cache it filled while overlapping holds the right K/V.
    assert tokens(overlapped.generate(batch, params)) == tokens(expected)
    assert_idle(overlapped)


def test_stop_token_and_seeded_sampling_equal_the_plain_loops(tiny_llama_dir: Path) -> None:
    batch = prompts(5, seed=3)
    free = engine(tiny_llama_dir, False).generate(batch[0], SamplingParams(max_tokens=8))
    stop = free[0].token_ids[3]  # emitted four tokens in: found one step late, then cut
    params = [
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]),
        SamplingParams(max_tokens=10, temperature=0.9, seed=7),
        SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=11),
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]),
        SamplingParams(max_tokens=10, temperature=0),
    ]
    expected = engine(tiny_llama_dir, False).generate(batch, params)
    got = engine(tiny_llama_dir, True).generate(batch, params)
    assert expected[0].finish_reason == "stop" and expected[0].token_ids[-1] == stop
    assert tokens(got) == tokens(expected)
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]


def test_a_stop_string_found_one_step_late_drops_the_extra_token(
    tiny_llama_tok_dir: Path,
) -> None:
    plain = engine(tiny_llama_tok_dir, False)
    text_prompts = ["Hello there", "The tea is", "One two three"]
    free = plain.generate(text_prompts, SamplingParams(max_tokens=16, temperature=0))
    text = free[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"no stop string to pick in {text!r}"
    params = SamplingParams(max_tokens=16, temperature=0, stop=[stop])
    expected = plain.generate(text_prompts, params)
    overlapped = engine(tiny_llama_tok_dir, True)
    got = overlapped.generate(text_prompts, params)
    assert expected[0].finish_reason == "stop" and len(expected[0].token_ids) < 16
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [
        (o.text, o.token_ids, o.finish_reason) for o in expected
    ]
    assert_idle(overlapped)


def test_an_abort_mid_run_ends_that_request_only(tiny_llama_dir: Path) -> None:
    batch = prompts(4, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = engine(tiny_llama_dir, False).generate(batch, params)
    llm = engine(tiny_llama_dir, True, num_kv_blocks=40, block_size=4)
    for i, prompt in enumerate(batch):
        llm.add_request(prompt, params, request_id=str(i))
    finished: dict[str, RequestOutput] = {}
    for _ in range(5):
        for out in llm.step():
            finished[out.request_id] = out
    assert llm.overlap is not None and llm.overlap.inflight is not None
    aborted = llm.abort_request("1")  # settles the step on the device first: its token counts
    assert llm.overlap.inflight is None
    assert aborted is not None and aborted.finish_reason == "abort"
    assert len(aborted.token_ids) == 5  # a prefill step, then four decodes: one a step
    assert aborted.token_ids == expected[1].token_ids[: len(aborted.token_ids)]
    for _ in range(40):
        if not llm.has_unfinished():
            break
        for out in llm.step():
            finished[out.request_id] = out
    assert sorted(finished) == ["0", "2", "3"]
    for rid in ("0", "2", "3"):
        assert finished[rid].token_ids == expected[int(rid)].token_ids
    assert_idle(llm)
    assert llm.block_manager.num_available_blocks() == llm.block_manager.num_blocks


def test_streamed_deltas_add_up_to_the_plain_loops_output(tiny_llama_tok_dir: Path) -> None:
    params = SamplingParams(max_tokens=10, temperature=0)
    text_prompts = ["Hello there", "The tea is"]
    expected = engine(tiny_llama_tok_dir, False).generate(text_prompts, params)
    llm = engine(tiny_llama_tok_dir, True)
    texts = ["", ""]
    streamed: list[list[int]] = [[], []]
    for delta in llm.stream(text_prompts, params):
        texts[delta.index] += delta.text
        streamed[delta.index] += delta.token_ids
    assert streamed == tokens(expected)
    assert texts == [o.text for o in expected]


def test_a_structured_or_logprobs_step_falls_back_to_the_synchronous_step(
    tiny_llama_dir: Path,
) -> None:
    """A step whose sampling reads the previous token on the host (log-probabilities,
    penalties) waits for it: same outputs, and the loop counts those steps."""
    batch = prompts(3, seed=5)
    params = [
        SamplingParams(max_tokens=6, temperature=0, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3),
        SamplingParams(max_tokens=6, temperature=0),
    ]
    expected = engine(tiny_llama_dir, False).generate(batch, params)
    llm = engine(tiny_llama_dir, True)
    got = llm.generate(batch, params)
    assert tokens(got) == tokens(expected)
    assert got[0].logprobs == expected[0].logprobs
    assert llm.overlap is not None and llm.overlap.synchronous_steps > 0


def test_threads_sharing_an_overlapped_engine(tiny_llama_dir: Path) -> None:
    """generate from two threads at once (the engine's lock serializes their steps)."""
    batch = prompts(4, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = tokens(engine(tiny_llama_dir, False).generate(batch, params))
    llm = engine(tiny_llama_dir, True)
    results: dict[int, list[list[int]]] = {}

    def run(half: int) -> None:
        results[half] = tokens(llm.generate(batch[2 * half : 2 * half + 2], params))

    threads = [threading.Thread(target=run, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results[0] + results[1] == expected


def test_a_request_that_fails_a_step_fails_alone(tiny_llama_dir: Path) -> None:
    """A launch that raises (on the CPU the forward runs as it is queued) is run again as the
    plain loop runs it: each request alone, and only the one that fails alone fails."""
    batch = prompts(3, seed=7)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = engine(tiny_llama_dir, False).generate(batch, params)
    llm = LLM(str(tiny_llama_dir), async_scheduling=True)
    forward = llm.runner.forward
    calls = iter(range(10**6))

    def fail_for_one(batch: Any, *args: Any) -> torch.Tensor:
        if next(calls) >= 2 and any(
            item.seq.prompt_token_ids == prompts(3, 7)[1] for item in batch
        ):
            raise RuntimeError("device fell over")
        return forward(batch, *args)

    llm.runner.forward = fail_for_one  # type: ignore[method-assign]
    got = llm.generate(batch, params)
    assert got[1].finish_reason == "error" and "device fell over" in (got[1].error or "")
    assert [got[0].token_ids, got[2].token_ids] == [expected[0].token_ids, expected[2].token_ids]
    assert llm.overlap is not None and llm.overlap.synchronous_steps > 0
    assert_idle(llm)


def test_a_step_the_device_fails_fails_its_requests_and_the_engine_goes_on(
    tiny_llama_dir: Path,
) -> None:
    """On the device the error surfaces only when the step's ids are read: that step's
    requests fail (a CUDA error cannot be pinned on one request), the cache it may have
    filled is dropped, and later requests run as before."""
    events: Events = []
    llm = engine(tiny_llama_dir, True, events)
    forward = llm.runner.forward
    calls = iter(range(10**6))

    def fail_once(*args: Any) -> torch.Tensor:
        if next(calls) == 3:
            raise RuntimeError("device fell over")
        return forward(*args)

    llm.runner.forward = fail_once  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate(prompts(2, seed=8), params)
    assert [o.finish_reason for o in got] == ["error", "error"]
    assert all("device fell over" in (o.error or "") for o in got)
    assert_idle(llm)
    later = prompts(2, seed=9)
    expected = engine(tiny_llama_dir, False).generate(later, params)
    assert tokens(llm.generate(later, params)) == tokens(expected)
    assert_idle(llm)


def test_the_command_line_takes_vllms_flag() -> None:
    seen: list[dict[str, Any]] = []

    @click.command()
    @engine_options
    def command(engine_options: dict[str, Any]) -> None:
        seen.append(engine_options)

    for args, wanted in (
        ([], None),
        (["--async-scheduling"], True),
        (["--no-async-scheduling"], False),
    ):
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 0, result.output
        assert seen[-1]["async_scheduling"] is wanted
    assert EngineConfig(device="cuda").overlaps_steps
    assert not EngineConfig(device="cpu").overlaps_steps
    assert EngineConfig(device="cpu", async_scheduling=True).overlaps_steps
    assert not EngineConfig(device="cuda", async_scheduling=False).overlaps_steps
    assert not EngineConfig(device="cuda", speculative_tokens=3).overlaps_steps


def test_a_sequence_preempted_with_its_token_in_flight_is_readmitted_right(
    tiny_llama_dir: Path,
) -> None:
    """A sequence preempted while its newest token is still on the device, and re-admitted at
    once, recomputes its whole context with that token's input read on the device (the
    scheduler's own preemptions rarely re-admit in the same step, so this one is forced)."""
    batch = prompts(3, seed=10)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = engine(tiny_llama_dir, False).generate(batch, params)
    llm = engine(tiny_llama_dir, True)
    for i, prompt in enumerate(batch):
        llm.add_request(prompt, params, request_id=str(i))
    finished: dict[str, RequestOutput] = {}
    for step in range(40):
        if not llm.has_unfinished():
            break
        if step in (3, 6):
            victim = llm.samples_of("1")[0]
            assert victim.pending_token  # its token of the step in flight: not read yet
            llm.scheduler._preempt(victim, SchedulerOutput())
        for out in llm.step():
            finished[out.request_id] = out
    assert [finished[str(i)].token_ids for i in range(3)] == tokens(expected)
    assert llm.scheduler.num_preemptions == 2
    assert_idle(llm)


def test_a_steps_inputs_go_over_in_one_packed_copy() -> None:
    """On a GPU a step's input arrays are packed into one pinned staging buffer and copied
    once (a pageable copy may wait for the step in flight); the packing, run here on the CPU,
    gives back every array with its dtype, shape and values, empty ones too."""
    rng = np.random.default_rng(0)
    arrays: list[np.ndarray] = [
        rng.integers(-(2**40), 2**40, size=5, dtype=np.int64),
        rng.integers(0, 2**31 - 1, size=3, dtype=np.int32),  # 12 bytes: the next starts aligned
        rng.integers(0, 2**31 - 1, size=(2, 3), dtype=np.int32),
        np.zeros(0, dtype=np.int64),
        np.array([7], dtype=np.int64),
        rng.integers(0, 2**31 - 1, size=(3, 1), dtype=np.int32)[::2],  # not contiguous
    ]
    packed = upload(arrays, torch.device("cpu"), pack=True)
    plain = upload(arrays, torch.device("cpu"), pack=False)
    for a, got, ref in zip(arrays, packed, plain, strict=True):
        assert got.dtype == ref.dtype and tuple(got.shape) == a.shape
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(a)))
    filled = [t for t in packed if t.numel()]  # an empty tensor has no address to check
    assert len({t.untyped_storage().data_ptr() for t in filled}) == 1  # one buffer: one copy
    assert all((t.data_ptr() - filled[0].data_ptr()) % ALIGN == 0 for t in filled)


def test_structured_outputs_beside_plain_requests(tiny_llama_tok_dir: Path) -> None:
    """A grammar's next mask needs the token on the host: each step holding a request with a
    grammar runs synchronously, the same tokens as the plain loop for every request."""
    pytest.importorskip("xgrammar")
    structure = StructuredOutputsParams(regex=r"(ab|c[de])+!")
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, seed=2, structured_outputs=structure),
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0, structured_outputs=structure),
    ]
    text_prompts = ["Hello there", "The tea is", "One two three"]
    expected = engine(tiny_llama_tok_dir, False).generate(text_prompts, params)
    llm = engine(tiny_llama_tok_dir, True)
    got = llm.generate(text_prompts, params)
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in expected]
    assert llm.overlap is not None and llm.overlap.synchronous_steps > 0
    assert_idle(llm)
