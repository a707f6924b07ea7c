"""The systems we measure against, run in the same process: transformers' static `generate`
with a padded batch, its continuous-batching `generate_batch`, its prompt lookup decoding,
and the unbatched greedy reference that every system's output is checked against."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from bench.workloads import BenchRequest

if TYPE_CHECKING:
    from transformers import GenerationMixin


class Sampling(NamedTuple):
    """How every system of a bench run samples; the bench is greedy (and checked) without it.
    `n` samples per prompt: SamplingParams.n in the engine, num_return_sequences in
    transformers' generate, n copies of each request in its continuous batching."""

    temperature: float
    top_p: float
    n: int = 1


def samples_per_prompt(sampling: Sampling | None) -> int:
    """How many samples every system makes of each prompt (one when greedy)."""
    return sampling.n if sampling else 1


def hf_sampling(sampling: Sampling | None) -> dict[str, object]:
    """transformers' generate options for `sampling`: its own top-k of 50 is turned off (0), so
    it filters exactly as the engine does."""
    if sampling is None:
        return {"do_sample": False}
    return {
        "do_sample": True,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": 0,
    }


class PeerResult(NamedTuple):
    outputs: list[list[int]]  # per request sample (request-major), cut after EOS and max_tokens
    wall_s: float
    prefill_tokens: int  # prompt tokens the system ran through the model
    ttft_s: list[float]  # per request, empty when the system does not expose it


def load_hf_model(path: Path, device: str) -> GenerationMixin:
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device)  # type: ignore[arg-type]  # transformers types .to() as a decorator
    model.eval()
    return model


# transformers stops at no token when told to stop at -1 (it warns); used for ignore_eos.
NO_STOP = [-1]


def stop_ids(requests: list[BenchRequest], eos_ids: set[int]) -> list[int]:
    """EOS ids for a batch: none when every request ignores EOS."""
    return NO_STOP if all(r.ignore_eos for r in requests) else sorted(eos_ids)


def cut_output(tokens: list[int], eos_ids: set[int], req: BenchRequest) -> list[int]:
    return (
        tokens[: req.max_tokens] if req.ignore_eos else cut_at_eos(tokens, eos_ids, req.max_tokens)
    )


def cut_at_eos(tokens: list[int], eos_ids: set[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    for token in tokens[:max_tokens]:
        out.append(token)
        if token in eos_ids:
            break
    return out


@torch.inference_mode()
def run_reference(
    model: GenerationMixin,
    requests: list[BenchRequest],
    eos_ids: set[int],
    device: str,
    **options: object,
) -> list[list[int]]:
    """Unbatched greedy `generate`, one request at a time: the ground truth. `options` are
    more of generate's arguments (prompt lookup, for hf-lookup)."""
    outputs = []
    for req in requests:
        ids = torch.tensor([req.prompt_token_ids], device=device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=req.max_tokens,
            do_sample=False,
            eos_token_id=stop_ids([req], eos_ids),
            pad_token_id=min(eos_ids),
            **options,
        )
        outputs.append(cut_output(gen[0, ids.shape[1] :].tolist(), eos_ids, req))
    return outputs


# transformers' prompt lookup decoding, with the draft length its documentation suggests:
# unbatched (its assisted generation takes one sequence at a time), greedy only.
HF_LOOKUP_TOKENS = 10


def run_hf_lookup(
    model: GenerationMixin, requests: list[BenchRequest], eos_ids: set[int], device: str
) -> PeerResult:
    """transformers' `generate(prompt_lookup_num_tokens=...)`, one request at a time."""
    start = time.perf_counter()
    outputs = run_reference(
        model, requests, eos_ids, device, prompt_lookup_num_tokens=HF_LOOKUP_TOKENS
    )
    prefill = sum(len(r.prompt_token_ids) for r in requests)
    return PeerResult(outputs, time.perf_counter() - start, prefill, [])


@torch.inference_mode()
def run_hf_static(
    model: GenerationMixin,
    requests: list[BenchRequest],
    eos_ids: set[int],
    device: str,
    batch_size: int,
    sampling: Sampling | None = None,
    options: dict[str, object] | None = None,
) -> PeerResult:
    """Classic static batching: left-padded batches of `batch_size`, each runs until its
    longest member is done (with n samples a prompt, its rows are repeated n times);
    `options` are more of generate's arguments (beam search, for the bench's --beam-width)."""
    samples = samples_per_prompt(sampling)
    pad = min(eos_ids)
    outputs: list[list[int]] = []
    prefill = 0
    start = time.perf_counter()
    ttft: list[float] = []
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, req in enumerate(batch):
            n = len(req.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(req.prompt_token_ids)
            mask[row, width - n :] = 1
        prefill += ids.numel()
        gen = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max(r.max_tokens for r in batch),
            **hf_sampling(sampling),
            **({"num_return_sequences": samples} if samples > 1 else {}),
            eos_token_id=stop_ids(batch, eos_ids),
            pad_token_id=pad,
            **(options or {}),
        )
        prefill += ids.numel() * (samples - 1)  # each row is repeated before the prompt runs
        for row in range(len(batch) * samples):  # transformers puts a prompt's samples together
            req = batch[row // samples]
            outputs.append(cut_output(gen[row, width:].tolist(), eos_ids, req))
    return PeerResult(outputs, time.perf_counter() - start, prefill, ttft)
