"""The batched sampler: each request's random stream, filters and draw.

`filtered_probs` filters rows on their likeliest candidates (runner/sampling/candidates.py) and
falls back, row by row, to `dense_probs`: the filters over the whole vocabulary, which define
what is kept. `draw` picks one token a row by inverse CDF in token-id order. Speculative decoding
(runner/engine/step/speculative.py) checks its guesses with these same two functions."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from runner.sampling.candidates import (
    TOP_K_WIDEST,
    Dense,
    Filtered,
    nucleus_at,
    softmax_rows,
    top_k_rows,
)
from runner.sampling.params import SamplingParams


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

    Greedy rows are one batched argmax (of those rows alone: over 262,144 logits an argmax
    costs as much as a softmax). Sampled rows are filtered together (filtered_probs) and drawn
    together by inverse CDF (draw), each from one uniform number of its own generator: a
    per-request stream is what makes a seeded request reproducible whatever else shares its
    batch. The result comes back to the host in one transfer.
    """
    return [int(t) for t in sample_on_device(logits, params, generators).tolist()]


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """`sample`'s tokens [N] int64, left on the logits' device: an overlapped step
    (runner/engine/step/overlap.py) reads them back later, and feeds them to the next step there."""
    if all(p.greedy for p in params):  # the usual step: no index to send (which would block)
        return logits.argmax(dim=-1) if params else logits.new_empty(0, dtype=torch.int64)
    tokens = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        tokens.index_copy_(0, index, _select(logits, greedy).argmax(dim=-1))
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        filtered = filtered_probs(_select(logits, rows), [params[i] for i in rows])
        uniforms = torch.cat([torch.rand(1, generator=generators[i]) for i in rows])
        tokens.index_copy_(0, index, draw(filtered, uniforms.to(logits.device)))
    return tokens


def _select(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of `x`: `x` itself when they are all of its rows in order (no copy)."""
    if rows == list(range(x.shape[0])):
        return x
    return x.index_select(0, torch.tensor(rows, device=x.device))


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> Filtered:
    """Each row's kept tokens and their unnormalised probabilities after its temperature, then
    top-k, top-p and min-p, exactly the set `dense_probs` keeps: rows without top-k take the
    dense softmax and decide on its likeliest candidates; rows with a top-k under TOP_K_WIDEST
    read only their top logits; the rest, and rows those cannot settle, take `dense_probs`."""
    n, vocab = logits.shape
    dev = logits.device
    logits = logits.float()
    out = Filtered(n, vocab, dev)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    plain = [i for i, k in enumerate(ks) if not k]
    if plain:
        rows = torch.tensor(plain, dtype=torch.int64, device=dev)
        softmax_rows(out, _select(logits, plain), rows, [params[i] for i in plain], NUCLEUS_WIDTHS)
    dense = [i for i, k in enumerate(ks) if k >= TOP_K_WIDEST]
    narrow = [i for i, k in enumerate(ks) if 0 < k < TOP_K_WIDEST]
    if narrow:
        rows = torch.tensor(narrow, dtype=torch.int64, device=dev)
        fallback = top_k_rows(out, _select(logits, narrow), rows, [params[i] for i in narrow])
        dense += fallback.tolist()
    if dense:
        dense.sort()
        probs = dense_probs(_select(logits, dense), [params[i] for i in dense])
        out.dense.append(Dense(torch.tensor(dense, dtype=torch.int64, device=dev), probs))
    return out


# Nucleus (top-p) search widths: the k most likely tokens are enough for most rows; a row whose
# nucleus is wider tries the next width, and a full sort is the last resort. A top-k of 8192 of
# the default model's 49152 logits costs a quarter of a sort: at temperature 1.3 (nuclei of
# ~2,000 tokens) it took 111 rows' filters from 216 ms to 90.
NUCLEUS_WIDTHS = (64, 1024, 8192)


def dense_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Unnormalised probabilities [n, vocab] after each row's temperature, then top-k, top-p
    and min-p, as vLLM defines them: top-k keeps the tokens whose logit reaches the k-th
    largest, top-p the most likely tokens until their mass reaches p (the top token always;
    tokens tied with the last one too), min-p those with at least min_p x the top probability.
    A dozen passes over the vocabulary: the definition `filtered_probs` matches, and its
    fallback for rows it cannot settle on candidates.
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
        rows, p = probs.index_select(0, pending), top_p.index_select(0, pending)
        if width < vocab:
            top = torch.topk(rows, width, dim=-1).values
        else:
            top = torch.sort(rows, dim=-1, descending=True).values
        last, settled = nucleus_at(top, p, complete=width == vocab)
        floor[pending[settled]] = last[settled]
        pending = pending[~settled]
    return floor


# Blocks of the two-level draw over a dense row: its block sums, then one block's tokens.
DRAW_BLOCK = 256


def draw(filtered: Filtered, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row [n] of what `filtered_probs` kept, by inverse CDF in token-id order:
    row i takes the token whose interval of the cumulative mass holds uniforms[i] (in [0, 1))
    x the row's total, so token t comes with probability mass[t] / total, a cut token never."""
    tokens = torch.empty(filtered.n, dtype=torch.int64, device=uniforms.device)
    for group in filtered.compact:
        picked = walk(group.probs, uniforms.index_select(0, group.rows))
        tokens.index_copy_(0, group.rows, group.ids.gather(1, picked[:, None])[:, 0])
    for dense in filtered.dense:
        tokens.index_copy_(0, dense.rows, draw_dense(dense.probs, uniforms[dense.rows]))
    return tokens


def walk(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The index [n] into each row of unnormalised `probs` [n, w] whose interval of the
    cumulative mass holds uniforms[i] x the row's total, one pass of sums over the row."""
    cdf = torch.cumsum(probs, dim=-1)  # [n, w], non-decreasing
    return _pick(cdf, probs > 0, uniforms * cdf[:, -1])


def draw_dense(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`walk` over whole-vocabulary rows [n, vocab] in two levels: the block holding the target
    among the rows' DRAW_BLOCK-token block sums (one reduction pass), then the token in it."""
    n, vocab = probs.shape
    whole = vocab // DRAW_BLOCK * DRAW_BLOCK
    sums = probs[:, :whole].unflatten(1, (-1, DRAW_BLOCK)).sum(dim=-1)  # [n, blocks]
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    cdf = torch.cumsum(sums, dim=-1)
    target = uniforms * cdf[:, -1]
    block = _pick(cdf, sums > 0, target)  # a block with mass: its sum lifts the cdf over target
    before = cdf.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0].masked_fill(block == 0, 0.0)
    ids = block[:, None] * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)
    inside = probs.gather(1, ids.clamp(max=vocab - 1)).masked_fill(ids >= vocab, 0.0)
    # target - before >= 0; rounding may put it at or past the block's own running total, which
    # takes the block's last token with mass.
    return block * DRAW_BLOCK + _pick(torch.cumsum(inside, dim=-1), inside > 0, target - before)


def _pick(cdf: torch.Tensor, has_mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first index [n] of each row of `cdf` [n, w] above target [n]; where rounding puts the
    target at the very top of the mass, the last index with any mass."""
    picked = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    last = cdf.shape[1] - 1 - has_mass.flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(picked, last)
