"""The batched sampler: each request's random stream, filters and draw."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from runner.sampling_params import SamplingParams


def request_generator(
    params: SamplingParams, engine_rng: torch.Generator
) -> torch.Generator | None:
    """The request's own random stream (None when greedy): seeded by `params.seed`, else by a
    draw from the engine's generator, so a seeded request samples the same in any batch. It
    lives on the CPU whatever the model's device: it gives one number a step, and drawing it
    there needs no device launch per request."""
    if params.greedy:
        return None
    seed = params.seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=engine_rng, device=engine_rng.device))
    return torch.Generator().manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Pick one token per row of `logits` [N, vocab] (float32).

    Greedy rows are one batched argmax. Sampled rows are filtered together (filtered_probs) and
    drawn together by inverse CDF (draw), each from one uniform number of its own generator: a
    per-request stream is what makes a seeded request reproducible whatever else shares its
    batch. The result comes back to the host in one transfer.
    """
    tokens = torch.argmax(logits, dim=-1)  # [N]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        probs = filtered_probs(logits.index_select(0, index), [params[i] for i in rows])
        uniforms = torch.cat([torch.rand(1, generator=generators[i]) for i in rows])
        tokens.index_copy_(0, index, draw(probs, uniforms.to(logits.device)))
    return [int(t) for t in tokens.tolist()]


# Nucleus (top-p) search widths: the k most likely tokens are enough for most rows; a row whose
# nucleus is wider tries the next width, and a full sort is the last resort. A top-k of 8192 of
# the default model's 49152 logits costs a quarter of a sort: at temperature 1.3 (nuclei of
# ~2,000 tokens) it took 111 rows' filters from 216 ms to 90.
NUCLEUS_WIDTHS = (64, 1024, 8192)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Unnormalised probabilities [n, vocab] after each row's temperature, then top-k, top-p
    and min-p, as vLLM defines them: top-k keeps the tokens whose logit reaches the k-th
    largest, top-p the most likely tokens until their mass reaches p (the top token always;
    tokens tied with the last one too), min-p those with at least min_p x the top probability.
    """
    n, vocab = logits.shape
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    scaled = logits.float() / temperature[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(scaled, max(ks), dim=-1).values  # [n, max k], descending
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=dev)[:, None], -math.inf)
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        probs = probs.masked_fill(probs < _nucleus_floor(probs, top_p)[:, None], 0.0)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the probability of the least likely token of the nucleus [n] (0 where top_p is
    1): in descending order, a token is in while the mass before it is under top_p."""
    n, vocab = probs.shape
    floor = torch.zeros(n, device=probs.device)
    pending = (top_p < 1.0).nonzero()[:, 0]
    for width in (*[w for w in NUCLEUS_WIDTHS if w < vocab], vocab):
        if not pending.numel():
            break
        rows, p = probs.index_select(0, pending), top_p.index_select(0, pending)[:, None]
        if width < vocab:
            top = torch.topk(rows, width, dim=-1).values
        else:
            top = torch.sort(rows, dim=-1, descending=True).values
        mass = torch.cumsum(top, dim=-1)
        # The top token is always in, even where p is below float32's range and reads as 0.
        inside = ((mass - top) < p).sum(dim=-1).clamp(min=1)
        # Every one of the `width` tokens in: the nucleus may reach past them, so the row tries
        # the next width. Not settled early where their mass reaches p: the next token's mass
        # before it, (mass + next) - next in float32, can round back below p (one ulp under 1.0)
        # and let that token in, as the full sort would; the answer must not hang on the width.
        settled = (inside < width) | (width == vocab)
        last = top[settled].gather(1, (inside[settled] - 1)[:, None])[:, 0]
        floor[pending[settled]] = last
        pending = pending[~settled]
    return floor


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalised `probs` [n, vocab] by inverse CDF: row i takes the
    token whose interval of the cumulative mass holds uniforms[i] (in [0, 1)) x the row's total,
    so token t comes with probability probs[t] / total and a token of mass 0 never does."""
    cdf = torch.cumsum(probs, dim=-1)  # [n, vocab], non-decreasing
    target = uniforms[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    # Rounding can put the target at the very top of the mass: the last token with any mass.
    last = probs.shape[1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(picked, last)
