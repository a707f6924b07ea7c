"""Repetition, presence and frequency penalties on a step's logits, as vLLM defines them.

The repetition penalty is transformers' (and vLLM's): for every token that appears in the prompt
or the output so far, a positive logit is divided by the penalty and a negative one multiplied,
so a penalty above 1 makes every seen token less likely. The presence and frequency penalties
are OpenAI's: over the output only, a logit loses `presence` once if its token was generated
at all and `frequency` per time it was. Repetition applies first, then the other two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runner.sampling import SamplingParams


def penalize(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[list[int]],
    outputs: Sequence[list[int]],
) -> torch.Tensor:
    """`logits` [N, vocab] with row i penalized by params[i] over its prompt and output token
    ids. Returns `logits` itself when no row asks for a penalty, else a new tensor: the input
    may be a CUDA graph's static buffer, which must keep the model's own values."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    dev = logits.device
    index = torch.tensor(rows, device=dev)
    picked = logits.index_select(0, index).float()  # [n, vocab]
    n, vocab = picked.shape
    output_counts = _counts([outputs[i] for i in rows], vocab, dev)  # [n, vocab]
    seen = output_counts > 0
    repetition = torch.tensor([params[i].repetition_penalty for i in rows], device=dev)[:, None]
    if bool((repetition != 1.0).any()):
        seen_anywhere = seen | (_counts([prompts[i] for i in rows], vocab, dev) > 0)
        scaled = torch.where(picked > 0, picked / repetition, picked * repetition)
        picked = torch.where(seen_anywhere, scaled, picked)
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=dev)[:, None]
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=dev)[:, None]
    picked = picked - frequency * output_counts - presence * seen
    return logits.float().index_copy(0, index, picked)


def _counts(token_lists: Sequence[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list. One
    bincount over row-offset ids, so the cost is one transfer of the ids, not one per row."""
    flat = [row * vocab + t for row, tokens in enumerate(token_lists) for t in tokens]
    ids = torch.tensor(flat, dtype=torch.int64, device=device)
    counts = torch.bincount(ids, minlength=len(token_lists) * vocab)
    return counts.view(len(token_lists), vocab).float()
